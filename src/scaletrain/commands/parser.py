"""The argument parser every command line of scaletrain uses: bad command lines are one line, exit code 2."""

from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """argparse that reports bad command lines as one line with exit code 2 (its usual code)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"scaletrain: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)
