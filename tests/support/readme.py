"""The documentation's marked regions, for tests that run or check its text exactly as written.

A region is the text between two HTML comments, ``<!-- KIND:NAME -->`` and ``<!-- /KIND -->``
(invisible on the rendered page), in the README or any page of the docs site (``docs/``); its
fenced code blocks are read by their info string (```` ```sh ````, ```` ```ini ````), so prose and
sample output beside them are never run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from arona_grpc.config import Settings
from arona_store.ranking import ranking_from_env

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
VARIABLE = re.compile(r"\bARONA_[A-Z0-9_]+\b")


def pages() -> list[Path]:
    """The README and every page of the docs site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def region(kind: str, name: str) -> str:
    """The text of the one region ``<!-- kind:name -->`` … ``<!-- /kind -->`` of the README and
    the docs pages."""
    pattern = re.compile(
        rf"^<!-- {re.escape(kind)}:{re.escape(name)} -->\n(.*?)^<!-- /{re.escape(kind)} -->$",
        re.S | re.M,
    )
    found = [text for page in pages() for text in pattern.findall(page.read_text())]
    assert len(found) == 1, f"the docs must hold one <!-- {kind}:{name} --> region"
    text: str = found[0]
    return text


def fenced_blocks(text: str, info: str) -> list[str]:
    """The bodies of ``text``'s fenced blocks whose info string is exactly ``info``."""
    return re.findall(rf"^```{re.escape(info)}\n(.*?)^```$", text, re.S | re.M)


class _Reads(Mapping[str, str]):
    """An empty environment that notes every name looked up in it."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.names.add(key)
        raise KeyError(key)

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self.names.add(key)
        return default

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.names.add(key)
        return False

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def gateway_variables() -> set[str]:
    """Every ``ARONA_*`` variable the gateway reads at start-up (its settings and the store's
    ranking), as the code looks them up, not as any document lists them."""
    reads = _Reads()
    Settings.from_env(reads)
    ranking_from_env(reads)
    return {name for name in reads.names if name.startswith("ARONA_")}
