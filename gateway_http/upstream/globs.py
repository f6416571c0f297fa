"""Globs as sets of model names: a name that some globs match and others do not, found without
trying names one by one.

The backends file needs it to check a fallback keyed by a glob: the backend named there must
serve every model the key sends its way, and a glob matches endlessly many names. A glob is read
exactly as :func:`fnmatch.fnmatchcase` reads it (``*``, ``?``, ``[…]`` and ``[!…]`` with ranges,
case-sensitive, no escapes; a ``[`` that is never closed is itself) into the small automaton it
is: one state per position, ``*`` a loop. The automata of all the globs concerned then run side
by side, one character at a time, over one character of each class no glob tells apart (a
class changes only at a character some glob writes, or just after one), so the search is finite
and its first hit is a shortest name.
"""

from __future__ import annotations

import fnmatch
import re
from collections import deque
from collections.abc import Iterable, Sequence

# A search that has not ended after this many combinations of positions gives up (raises
# Undecided): far beyond any backends file's globs, it only bounds a pathological one.
_MAX_STATES = 200_000
_LAST_CHAR = 0x10FFFF
# The character chosen for a class when it holds one of these: names shown read like names.
_READABLE = "abcdefghijklmnopqrstuvwxyz0123456789-._/:"

# The tokens of a glob: any run of characters, any one character; a one-character string is
# that character, a longer one a ``[…]`` class.
_STAR = "*"
_ANY = "?"

_Token = str
# (which glob, how many of its tokens were matched); every group numbers its globs alike, so
# the same glob in two groups is the same position in both.
_Position = tuple[int, int]
_Positions = frozenset[_Position]
_NOWHERE: _Positions = frozenset()


class Undecided(Exception):
    """The globs are too many or too intricate to tell within the search's bound."""


def example(all_of: Sequence[Iterable[str]], none_of: Iterable[str] = ()) -> str | None:
    """A shortest name matched by at least one glob of each group of ``all_of`` and by no glob
    of ``none_of``; None when there is none.

    A name without ``*``, ``?`` or ``[`` is a glob that matches itself only (:func:`literal`
    makes any name one). Raises :class:`Undecided` past the search's bound."""
    numbers: dict[str, int] = {}
    groups = [
        [numbers.setdefault(pattern, len(numbers)) for pattern in group]
        for group in (*all_of, none_of)
    ]
    globs = [_tokens(pattern) for pattern in numbers]
    tokens = {token for each in globs for token in each}
    alphabet = _alphabet(tokens)
    # The characters of the alphabet each token takes: a class as fnmatch reads it (ranges,
    # negation, empty ranges), a literal itself only (always a class of its own).
    takes = {
        token: [k for k, char in enumerate(alphabet) if fnmatch.fnmatchcase(char, token)]
        for token in tokens
        if len(token) > 1
    }
    takes.update((char, [k]) for k, char in enumerate(alphabet))
    takes[_STAR] = takes[_ANY] = list(range(len(alphabet)))

    start = tuple(_closure(globs, ((number, 0) for number in group)) for group in groups)
    seen = {start}
    queue: deque[tuple[tuple[_Positions, ...], str]] = deque([(start, "")])
    while queue:
        state, name = queue.popleft()
        *wanted, unwanted = state
        if all(_accepts(globs, each) for each in wanted) and not _accepts(globs, unwanted):
            return name
        moves = [_moves(globs, positions, takes) for positions in state]
        for k, char in enumerate(alphabet):
            # A wanted group that can no longer match: nothing to find this way.
            if not all(k in each for each in moves[:-1]):
                continue
            after = tuple(each.get(k, _NOWHERE) for each in moves)
            if after in seen or _covered(globs, after):
                continue
            if len(seen) >= _MAX_STATES:
                raise Undecided
            seen.add(after)
            queue.append((after, name + char))
    return None


def literal(name: str) -> str:
    """The glob that matches ``name`` only, whatever characters it holds."""
    return re.sub(r"([*?[])", r"[\1]", name)


def _tokens(pattern: str) -> tuple[_Token, ...]:
    """``pattern`` as tokens, split where :func:`fnmatch.translate` splits it."""
    tokens: list[_Token] = []
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        i += 1
        if char == "*":
            if not tokens or tokens[-1] != _STAR:
                tokens.append(_STAR)
        elif char == "?":
            tokens.append(_ANY)
        elif char == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                tokens.append("[")  # never closed: the character itself
            else:
                tokens.append(pattern[i - 1 : j + 1])
                i = j + 1
        else:
            # Never * or ?: written bare they are wildcards, so a token "*" is never literal.
            tokens.append(char)
    return tuple(tokens)


def _alphabet(tokens: Iterable[_Token]) -> list[str]:
    """One character of each class of characters that no token tells apart, readable first."""
    edges = {0}
    for token in tokens:
        if token in (_STAR, _ANY):
            continue
        for char in token:
            edges.add(ord(char))
            edges.add(min(ord(char) + 1, _LAST_CHAR))
    starts = sorted(edges)
    chosen = []
    for k, first in enumerate(starts):
        last = starts[k + 1] - 1 if k + 1 < len(starts) else _LAST_CHAR
        readable = [char for char in _READABLE if first <= ord(char) <= last]
        chosen.append(readable[0] if readable else chr(first))
    return sorted(chosen, key=_readable_first)


def _readable_first(char: str) -> tuple[int, int]:
    return (0, _READABLE.index(char)) if char in _READABLE else (1, ord(char))


def _closure(globs: Sequence[tuple[_Token, ...]], positions: Iterable[_Position]) -> _Positions:
    """``positions`` and those a ``*`` reaches by matching nothing."""
    closed: set[_Position] = set()
    for number, at in positions:
        tokens = globs[number]
        closed.add((number, at))
        while at < len(tokens) and tokens[at] == _STAR:
            at += 1
            closed.add((number, at))
    return frozenset(closed)


def _moves(
    globs: Sequence[tuple[_Token, ...]], positions: _Positions, takes: dict[_Token, list[int]]
) -> dict[int, _Positions]:
    """Where ``positions`` go on each character of the alphabet (by its index; none: nowhere),
    all at once: a literal moves on one character only, which keeps many exact names cheap."""
    moved: dict[int, list[_Position]] = {}
    for number, at in positions:
        tokens = globs[number]
        if at == len(tokens):
            continue
        token = tokens[at]
        after = (number, at if token == _STAR else at + 1)
        for k in takes[token]:
            moved.setdefault(k, []).append(after)
    return {k: _closure(globs, each) for k, each in moved.items()}


def _accepts(globs: Sequence[tuple[_Token, ...]], positions: _Positions) -> bool:
    return any(at == len(globs[number]) for number, at in positions)


def _covered(globs: Sequence[tuple[_Token, ...]], state: tuple[_Positions, ...]) -> bool:
    """Whether every name going on from ``state`` is matched by the unwanted globs: one of
    them is at its trailing ``*``, or they are where one wanted group is (and more)."""
    *wanted, unwanted = state
    # Runs of * are one token, so a trailing * is the last token.
    return any(
        at == len(globs[number]) - 1 and globs[number][at] == _STAR for number, at in unwanted
    ) or any(each <= unwanted for each in wanted)
