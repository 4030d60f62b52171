"""`python -m nexa` and the PyInstaller entry point."""

from __future__ import annotations

import sys

from nexa.cli import main

if __name__ == "__main__":
    sys.exit(main())
