"""Every test here runs in its own temporary directory.

Settings default ``ARONA_DATA_DIR`` to ``.arona`` (relative), and a failed writeback
creates the outbox there: tests must not leave it in the checkout.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
