"""The docs site says what the code does: its configuration reference names every variable the
gateway, the service and the store read (and nothing else), its command-line reference every
command of the parser with each of its options, and the README stays a front door.

(``make test`` builds the site with ``mkdocs build --strict``: a broken link, an anchor that is not
there or a page left out of the navigation fails it.)"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from gateway_http.commands import build_parser
from tests.support.readme import DOCS, README, ROOT

CONFIGURATION = DOCS / "reference" / "configuration.md"
CLI = DOCS / "reference" / "cli.md"
PACKAGES = ("arona_common", "arona_grpc", "gateway_http", "arona_store")
VARIABLE = re.compile(r"ARONA_[A-Z0-9_]+")
# A row of a Markdown table: its first cell, and the rest.
ROW = re.compile(r"^\| (.+?) \| (.*)$", re.M)
MAX_README_LINES = 300


def _read_in_code() -> set[str]:
    """Every ``ARONA_*`` name the packages spell out as a string."""
    return {
        match.group(0)[1:-1]
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        for match in re.finditer(r'"ARONA_[A-Z0-9_]+"', path.read_text(encoding="utf-8"))
    }


def _table_rows(path: Path) -> list[tuple[str, str]]:
    return [(first, rest) for first, rest in ROW.findall(path.read_text()) if first != "---"]


def test_the_configuration_reference_names_every_variable_read_and_no_other() -> None:
    page = CONFIGURATION.read_text()
    documented = {
        name for first, _ in _table_rows(CONFIGURATION) for name in VARIABLE.findall(first)
    }
    in_code = _read_in_code()
    assert in_code - set(VARIABLE.findall(page)) == set(), "read, but not on the page"
    assert documented - in_code == set(), "on the page, but read nowhere"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command (``budget set`` for a nested one) and its parser."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = _commands(sub)
                if nested:
                    found.update({f"{name} {inner}": p for inner, p in nested.items()})
                else:
                    found[name] = sub
    return found


def test_the_command_line_reference_shows_every_command_and_its_options() -> None:
    rows = [first for first, _ in _table_rows(CLI) if first.startswith("`arona-gateway ")]
    shown = "\n".join(rows)
    commands = _commands(build_parser())
    for command, parser in commands.items():
        words = command.split()
        assert any(
            re.search(rf"arona-gateway {re.escape(words[0])}\b", row)
            and all(word in row for word in words[1:])
            for row in rows
        ), f"`arona-gateway {command}` is not in {CLI.relative_to(ROOT)}"
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue  # internal: how `serve --workers` starts its children
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert option in shown, f"{command} {option} is not in the reference"
    named = {re.match(r"`arona-gateway ([a-z-]+)", row).group(1) for row in rows}  # type: ignore[union-attr]
    assert named == {command.split()[0] for command in commands}


def test_the_readme_is_a_front_door_whose_links_reach_the_docs() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    links = re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links its pages"
    for link in links:
        assert (ROOT / link).exists(), f"README links {link}, which is not there"
