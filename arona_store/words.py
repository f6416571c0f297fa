"""The words of a question: what the full-text index is asked for.

A question becomes its searchable words (lower-cased, stop words out, at most
:data:`MAX_QUERY_TERMS`), OR-ed in an FTS5 expression in which every word is a quoted phrase, so
no FTS5 syntax a user types can come through.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# Bounds the FTS expression (and so the work per query) whatever the user pastes in.
MAX_QUERY_TERMS = 32

# Same notion of a token as FTS5's unicode61 tokenizer: runs of letters and digits; the
# underscore separates, as it does there.
WORD = re.compile(r"[^\W_]+")

# Words that carry no topic on their own; a query made only of them matches nothing, so a
# question like "what do you know?" does not return the whole store.
STOP_WORDS = frozenset(
    """
    a about above after again against all am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further
    had has have having he her here hers herself him himself his how i if in into is it its
    itself just me more most my myself no nor not now of off on once only or other our ours
    ourselves out over own same she should so some such than that the their theirs them
    themselves then there these they this those through to too under until up very was we were
    what when where which while who whom why will with would you your yours yourself yourselves
    s t d ll m re ve don doesn didn isn aren wasn weren won wouldn shouldn couldn let lets
    """.split()
)


def query_terms(text: str) -> list[str]:
    """The searchable words of free user text: lower-cased, stop words dropped, de-duplicated.

    Only letters and digits survive, so no FTS5 syntax (``NEAR``, ``*``, ``-``, ``:``, ``(``,
    quotes) can come through; at most :data:`MAX_QUERY_TERMS` words are kept.
    """
    terms: list[str] = []
    seen: set[str] = set()
    for match in WORD.finditer(text.lower()):
        word = match.group()
        if word in STOP_WORDS or word in seen:
            continue
        seen.add(word)
        terms.append(word)
        if len(terms) >= MAX_QUERY_TERMS:
            break
    return terms


def fts_expression(terms: Sequence[str]) -> str | None:
    """An FTS5 MATCH expression OR-ing the quoted ``terms``; None when there are none.

    Quoting makes every word a phrase, so even ``near`` or ``and`` is never an operator; OR
    lets a partial match rank (BM25 rewards matching more of the words).
    """
    if not terms:
        return None
    return " OR ".join(f'"{term}"' for term in terms)


def build_fts_query(text: str) -> str | None:
    """Turn free user text into a safe FTS5 expression, or None when nothing is searchable."""
    return fts_expression(query_terms(text))
