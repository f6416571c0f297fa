"""The lexical score of a memory: the BM25 of its words and of its context, recency breaking
near-ties only.

The formula (:mod:`arona_store.lexical` reads the two BM25 values from SQLite)::

    turn      = max(0, -bm25(nodes_fts))              # the memory's own words
    context   = max(0, -bm25(nodes_ctx))              # its context document (arona_store.context)
    strength  = turn + 2 * context
    relevance = 0.2 + 0.8 * strength / (strength + 12)   # in [0.2, 1): any match counts a bit
    age_days  = max(0, now - created_at) / 86400
    recency   = 0.5 ** (age_days / 14)                # 14-day half-life, in (0, 1]
    score     = relevance * (0.98 + 0.02 * recency)   # in (0, 1)

Recency only breaks near-ties: a memory of last year scores at most 2 % under one of today,
so an old memory that matches better still comes first (with the 0.6 + 0.4 blend used before,
a relevant memory a few months old lost to any weaker recent one: LoCoMo's R@5 with memories
dated by session was 16.8 words-only). The floor on ``relevance`` exists because FTS5 clamps
the IDF of a term present in half the documents or more to almost zero, which on a small
store would report every match as worthless.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from arona_store.nodes import KEY_SCALE

HALF_LIFE_DAYS = 14.0
RELEVANCE_FLOOR = 0.2
# The context document's BM25 counts this many times the memory's own.
CONTEXT_WEIGHT = 2.0
# Each neighbour's context document (two each side) counts this many times its BM25: a wider
# context, without storing one.
NEIGHBOUR_WEIGHT = 0.5
# The strength at which relevance is halfway between the floor and 1.
SATURATION = 12.0
RECENCY_WEIGHT = 0.02
# A memory that only asks a question (or only repeats one) weighs this share of what it would.
QUESTION_WEIGHT = 0.6
SECONDS_PER_DAY = 86400.0
# recency = exp((seq - now_key) * DECAY_PER_KEY) for a node older than now.
DECAY_PER_KEY = math.log(2.0) / (HALF_LIFE_DAYS * SECONDS_PER_DAY * KEY_SCALE)


def strength_of(turn: float, context: float, near: Sequence[float] = ()) -> float:
    """How strongly a memory matches the words of a question: the (positive) BM25 of its own
    text, plus :data:`CONTEXT_WEIGHT` times that of its context document, plus
    :data:`NEIGHBOUR_WEIGHT` times those of its neighbours' context documents (``near``)."""
    return (
        max(0.0, turn)
        + CONTEXT_WEIGHT * max(0.0, context)
        + NEIGHBOUR_WEIGHT * sum(max(0.0, n) for n in near)
    )


def relevance_of(strength: float) -> float:
    """Map a match's strength into [RELEVANCE_FLOOR, 1)."""
    s = max(0.0, strength)
    return RELEVANCE_FLOOR + (1.0 - RELEVANCE_FLOOR) * s / (s + SATURATION)


def recency_of(created_at: float, now: float) -> float:
    """The 14-day half-life decay; a timestamp in the future counts as brand new."""
    age_days = max(0.0, now - created_at) / SECONDS_PER_DAY
    return float(0.5 ** (age_days / HALF_LIFE_DAYS))


def score_of(turn_bm25: float, context_bm25: float, created_at: float, now: float) -> float:
    """The lexical score in (0, 1) from FTS5's bm25() values (negative, smaller is better)."""
    relevance = relevance_of(strength_of(-turn_bm25, -context_bm25))
    recency = recency_of(created_at, now)
    return relevance * ((1.0 - RECENCY_WEIGHT) + RECENCY_WEIGHT * recency)


def is_question(text: str) -> bool:
    """Whether a memory only asks (its every sentence of three words or more is a question), or
    only repeats a question: an assistant reply whose words are all the user's (an echo).

    Such a memory weighs :data:`QUESTION_WEIGHT` of what it would: "Which tea do I prefer?"
    stored earlier shares every word with the same question asked again, but it is the fact
    ("I prefer oolong tea") that answers it."""
    user, assistant = _sides(text)
    if not _only_questions(user):
        return False
    if not assistant.strip():
        return True
    asked = set(_WORDS.findall(user.lower()))
    said = [w for w in _WORDS.findall(assistant.lower()) if w not in _ECHO_WORDS]
    return bool(said) and sum(w in asked for w in said) >= 0.8 * len(said)


def _sides(text: str) -> tuple[str, str]:
    """The user's and the assistant's side of an episode (``User: …\nAssistant: …``); the
    whole text as the user's for anything else."""
    found = _EPISODE.match(text)
    if found is None:
        return text, ""
    return found.group(1), found.group(2) or ""


def _only_questions(text: str) -> bool:
    sentences = [s.strip() for s in _sentences(text) if len(_WORDS.findall(s)) >= 3]
    return bool(sentences) and all(_asks(s) for s in sentences)


def _sentences(text: str) -> list[str]:
    """The runs of ``text`` that end with their punctuation, and the last one (a line
    ending without punctuation is no sentence: chat lines that only trail off).

    In one pass: a pattern that can fail after a long run (a run that must end in
    punctuation) is retried from every character of that run, which made a 16,000-character
    word without a full stop cost eleven seconds."""
    end = len(text.removesuffix("\n"))
    found = []
    for run in _SENTENCE.finditer(text):
        if run.group().endswith((".", "!", "?")) or run.end() >= end:
            found.append(run.group())
    return found


def _asks(sentence: str) -> bool:
    """A question mark, or a question word first and no full stop (chat often drops the
    question mark)."""
    if sentence.endswith("?"):
        return True
    first = _WORDS.search(sentence.lower())
    return first is not None and first.group() in _QUESTION_WORDS and sentence[-1:] not in ".!"


def recency_factor(seq: int, now_key: int) -> float:
    """``0.98 + 0.02 * recency`` of the node at key ``seq``: what breaks near-ties."""
    return (1.0 - RECENCY_WEIGHT) + RECENCY_WEIGHT * math.exp(min(0, seq - now_key) * DECAY_PER_KEY)


_WORDS = re.compile(r"[^\W_]+")
# Runs of a line, each with the punctuation that ends it (if any): it always matches, so
# never backtracks (:func:`_sentences` keeps the sentences among them).
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]*")
_EPISODE = re.compile(r"\AUser:[ \t]*(.*?)(?:\nAssistant:[ \t]*(.*))?\Z", re.DOTALL)
_QUESTION_WORDS = frozenset(
    "what which who whom whose where when why how do does did is are am was were can could"
    " would should will shall may".split()
)
# What an echo adds to the question it repeats.
_ECHO_WORDS = frozenset({"echo"})
