"""The ``arona-gateway`` entry point (also ``python -m gateway_http.cli``); the commands themselves
are in :mod:`gateway_http.commands`, one module per group."""

from __future__ import annotations

import sys

from gateway_http.commands import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
