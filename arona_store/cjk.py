"""Chinese, Japanese and Korean text: its overlapping character pairs.

FTS5's unicode61 tokenizer makes a run of such characters one token, so a second FTS5 index
(``nodes_cjk``) holds their overlapping character pairs (a run of one character as itself),
written with the node and kept by triggers on delete and move. A query holding such characters
also matches its pairs there, scored by the same formula over that index (its scan stops by
recency alone, with a relevance bound of 1), and a node counts with the better of its two
scores. Queries without them run exactly as before.
"""

from __future__ import annotations

import re

from arona_store.words import WORD

# Scripts written without spaces between words (Han, kana, Hangul): unicode61 makes a whole run
# of them one token, so they are also indexed as overlapping character pairs (module docstring).
CJK_RUN = re.compile(
    "[\u1100-\u11ff\u3040-\u30ff\u3130-\u318f\u31f0-\u31ff\u3400-\u4dbf"
    "\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f\U00020000-\U0002ffff]+"
)

INSERT_CJK = "INSERT INTO nodes_cjk (rowid, grams) VALUES (?, ?)"


def cjk_grams(text: str) -> list[str]:
    """The character pairs of ``text``'s runs of Chinese, Japanese or Korean characters (a
    run of one character is kept whole), lower-cased, de-duplicated, in order."""
    grams: list[str] = []
    seen: set[str] = set()
    for match in CJK_RUN.finditer(text.lower()):
        run = match.group()
        pieces = [run] if len(run) == 1 else [run[i : i + 2] for i in range(len(run) - 1)]
        for gram in pieces:
            if gram not in seen:
                seen.add(gram)
                grams.append(gram)
    return grams


def cjk_share(text: str) -> float:
    """The share of ``text``'s letters and digits that are Chinese, Japanese or Korean."""
    letters = sum(len(m.group()) for m in WORD.finditer(text))
    if not letters:
        return 0.0
    return sum(len(m.group()) for m in CJK_RUN.finditer(text)) / letters


def cjk_index_text(text: str) -> str | None:
    """What the character-pair index holds for ``text``; None when it has no such run."""
    grams = cjk_grams(text)
    return " ".join(grams) if grams else None
