"""pdkv's command line. `main` is the console script; `run` is the same for tests."""

from pdkv.cli.app import build_app, main, run

__all__ = ["build_app", "main", "run"]
