import sys

from gradwatch.cli import main

sys.exit(main())
