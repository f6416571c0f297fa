"""``make test`` installs the Debian packages its tests run for real, and only those missing.

``scripts/system-deps.sh`` runs for real here, against a directory standing for the machine's
root (``SYSTEM_DEPS_ROOT``) and a ``PATH`` whose ``id``, ``sudo`` and ``apt-get`` are
stand-ins that write down how they were called: what the script would change on a machine is
exactly the ``apt-get`` lines it leaves behind.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "system-deps.sh"


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    calls: list[str]


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)


def run_script(
    tmp_path: Path,
    *,
    uid: int = 0,
    sudo: bool = False,
    chromium: bool = False,
    postgres: bool = False,
    apt_fails: bool = False,
) -> Run:
    """The script on a machine with what is asked installed (as files under a fake root)."""
    root, shims, log = tmp_path / "root", tmp_path / "bin", tmp_path / "calls"
    root.mkdir()
    log.touch()
    if chromium:
        _executable(root / "usr/bin/chromium", "#!/bin/sh\n")
    if postgres:
        for name in ("initdb", "pg_ctl"):
            _executable(root / f"usr/lib/postgresql/15/bin/{name}", "#!/bin/sh\n")
    _executable(shims / "id", f"#!/bin/sh\necho {uid}\n")
    _executable(
        shims / "apt-get",
        f'#!/bin/sh\necho "apt-get DEBIAN_FRONTEND=$DEBIAN_FRONTEND $*" >> {log}\n'
        + ('echo "E: Unable to locate package chromium"\nexit 100\n' if apt_fails else ""),
    )
    # Password-less sudo runs the command; otherwise `sudo -n` fails as a real one does.
    _executable(
        shims / "sudo",
        f'#!/bin/sh\necho "sudo $*" >> {log}\n'
        + ('[ "$1" = -n ] && shift\nexec "$@"\n' if sudo else "exit 1\n"),
    )
    done = subprocess.run(
        [str(SCRIPT)],
        env={"PATH": f"{shims}:/usr/bin:/bin", "SYSTEM_DEPS_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    calls = log.read_text(encoding="utf-8").splitlines()
    return Run(done.returncode, done.stdout, done.stderr, calls)


def test_with_everything_installed_it_changes_nothing_and_needs_no_root(tmp_path: Path) -> None:
    run = run_script(tmp_path, uid=1000, chromium=True, postgres=True)
    assert (run.returncode, run.stdout, run.stderr, run.calls) == (0, "", "", [])


@pytest.mark.parametrize(
    ("chromium", "postgres", "packages"),
    [
        (False, False, "chromium postgresql"),
        (False, True, "chromium"),
        (True, False, "postgresql"),
    ],
)
def test_as_root_it_updates_once_and_installs_only_what_is_missing(
    tmp_path: Path, chromium: bool, postgres: bool, packages: str
) -> None:
    run = run_script(tmp_path, chromium=chromium, postgres=postgres)
    assert run.returncode == 0, run.stderr
    assert run.calls == [
        "apt-get DEBIAN_FRONTEND=noninteractive update -qq",
        f"apt-get DEBIAN_FRONTEND=noninteractive install -y -qq {packages}",
    ]
    assert f"installing the Debian packages the tests use: {packages}" in run.stdout


def test_a_user_with_password_less_sudo_installs_through_it(tmp_path: Path) -> None:
    run = run_script(tmp_path, uid=1000, sudo=True, postgres=True)
    assert run.returncode == 0, run.stderr
    assert run.calls == [
        "sudo -n true",
        "sudo -n env DEBIAN_FRONTEND=noninteractive apt-get update -qq",
        "apt-get DEBIAN_FRONTEND=noninteractive update -qq",
        "sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium",
        "apt-get DEBIAN_FRONTEND=noninteractive install -y -qq chromium",
    ]


def test_without_root_or_sudo_it_fails_with_the_command_to_run(tmp_path: Path) -> None:
    run = run_script(tmp_path, uid=1000)
    assert run.returncode != 0
    assert not [call for call in run.calls if call.startswith("apt-get")]
    assert len(run.stderr.splitlines()) == 1
    assert "sudo sh -c 'apt-get update && apt-get install -y chromium postgresql'" in run.stderr


def test_a_failing_apt_get_fails_with_its_own_output(tmp_path: Path) -> None:
    run = run_script(tmp_path, apt_fails=True)
    assert run.returncode != 0
    assert "E: Unable to locate package chromium" in run.stderr
    assert run.calls == ["apt-get DEBIAN_FRONTEND=noninteractive update -qq"]


def test_make_test_installs_them_and_ci_runs_only_make_test() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    test_rule = re.search(r"^test:(.*)$", makefile, re.MULTILINE)
    run_rule = re.search(r"^run:(.*)$", makefile, re.MULTILINE)
    assert test_rule is not None and run_rule is not None
    assert "system-deps" in test_rule.group(1).split()
    assert "system-deps" not in run_rule.group(1).split()
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    commands = [
        line.strip()
        for line in ci.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert commands[-1] == "make test"
    assert "apt-get" not in ci and "playwright install" not in ci
