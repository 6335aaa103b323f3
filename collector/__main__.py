"""``python -m gradwatch.collector``: the collector daemon, as ``gradwatch collector``."""

from gradwatch.collector.cli import collector_main

if __name__ == "__main__":
    raise SystemExit(collector_main())
