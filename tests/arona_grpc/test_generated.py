"""The checked-in stubs match the protos, and the API stays lint-clean and compatible."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "arona_grpc" / "_gen"
BASELINE = Path(__file__).parent / "data" / "baseline.binpb"


def _files(folder: Path) -> list[str]:
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def test_checked_in_stubs_are_fresh(tmp_path: Path) -> None:
    out = tmp_path / "_gen"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(out)],
        check=True,
        capture_output=True,
    )
    assert _files(out) == _files(GEN)
    stale = [f for f in _files(GEN) if not filecmp.cmp(out / f, GEN / f, shallow=False)]
    assert stale == [], f"run `make gen`: stale generated files {stale}"


def _buf() -> str:
    found = shutil.which("buf", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("buf is not installed (pip package buf-bin)")
    return found


def test_buf_lint_and_format_clean() -> None:
    lint = subprocess.run([_buf(), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        [_buf(), "format", "--diff", "--exit-code"], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_no_breaking_change_against_baseline() -> None:
    result = subprocess.run(
        [_buf(), "breaking", "--against", str(BASELINE)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_breaking_check_catches_a_removed_field(tmp_path: Path) -> None:
    # The check is only worth something if it can fail: drop a field and look.
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    proto = tmp_path / "protos" / "arona" / "memory" / "v1" / "memory_service.proto"
    proto.write_text(proto.read_text().replace("  string node_id = 2;\n", "", 1))
    result = subprocess.run(
        [_buf(), "breaking", "--against", str(BASELINE)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "node_id" in result.stdout + result.stderr
