"""``python -m gradwatch.collector``: the collector daemon, exactly as ``gradwatch collector``.

It goes through the ``gradwatch`` command's dispatcher, so a base install
(``pip install gradwatch``, no extras) gets the same one line naming
``pip install 'gradwatch[collector]'`` and exit status 2 instead of an
ImportError traceback, and a closed pipe or ``--log-format`` behave the same.
"""

import sys

from gradwatch.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["collector", *sys.argv[1:]]))
