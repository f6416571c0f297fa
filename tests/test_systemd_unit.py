"""deploy/arona-gateway.service: what docs/deploying.md shows, systemd accepts, and it runs the real
command with variables the gateway reads, stopping as ``serve --workers`` needs."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gateway_http import workers
from gateway_http.commands import build_parser
from tests.support.readme import ROOT, VARIABLE, fenced_blocks, gateway_variables, region

UNIT = ROOT / "deploy" / "arona-gateway.service"


def _settings(text: str) -> dict[str, list[str]]:
    """Each ``Key=`` of the unit's [Service] section with its values, in order."""
    found: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def test_the_docs_show_the_unit_file_as_it_is() -> None:
    shown = fenced_blocks(region("file", "deploy/arona-gateway.service"), "ini")
    assert shown == [UNIT.read_text()], "docs/deploying.md's unit differs from the file"


def test_the_unit_runs_the_real_command_with_variables_the_gateway_reads() -> None:
    service = _settings(UNIT.read_text())
    (exec_start,) = service["ExecStart"]
    argv = shlex.split(exec_start)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert Path(argv[0]).name in scripts
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.workers) == ("serve", 4)
    # Secrets come from a file, never from the unit (which anyone may read).
    assert service["EnvironmentFile"] == ["/etc/arona/arona.env"]
    named = set(VARIABLE.findall(UNIT.read_text()))
    assert named <= gateway_variables(), sorted(named - gateway_variables())
    assert service["Restart"] == ["on-failure"]


def test_the_unit_lets_serve_stop_its_workers_before_its_grpc_service() -> None:
    service = _settings(UNIT.read_text())
    # SIGTERM to `serve` alone: it stops the workers, then the gRPC service.
    assert service["KillMode"] == ["mixed"]
    # systemd's SIGKILL never comes before serve's own bounded stop has run its course.
    (timeout,) = service["TimeoutStopSec"]
    assert int(timeout) > 2 * workers.STOP_TIMEOUT_S


@pytest.mark.timeout(200)
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is required under CI", pytrace=False)
        pytest.skip("systemd-analyze is not installed")
    # The unit as written, but running this checkout's command: verify checks that it exists.
    command = str(Path(sys.executable).parent / "arona-gateway")
    unit = tmp_path / UNIT.name
    text = UNIT.read_text()
    assert text.count("/opt/arona/.venv/bin/arona-gateway") == 1
    unit.write_text(text.replace("/opt/arona/.venv/bin/arona-gateway", command))
    # Without man pages and generators: neither concerns the unit, and on a loaded machine
    # running them took more than a minute once (it takes a fifth of a second idle).
    done = subprocess.run(
        [analyze, "verify", "--man=no", "--generators=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    # An unknown key or a value systemd cannot parse is only a warning naming the file.
    assert done.returncode == 0 and unit.name not in done.stderr, done.stderr
