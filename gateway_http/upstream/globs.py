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

# A search that has not ended after this many combinations of positions gives up (answers
# None): far beyond any backends file's globs, it only bounds a pathological one.
_MAX_STATES = 50_000
_LAST_CHAR = 0x10FFFF
# The character chosen for a class when it holds one of these: names shown read like names.
_READABLE = "abcdefghijklmnopqrstuvwxyz0123456789-._/:"

# The tokens of a glob: any run of characters, any one character; a one-character string is
# that character, a longer one a ``[…]`` class.
_STAR = "*"
_ANY = "?"

_Token = str
# (which glob of its group, how many of its tokens were matched)
_Position = tuple[int, int]
_State = tuple[frozenset[_Position], ...]


def example(all_of: Sequence[Iterable[str]], none_of: Iterable[str] = ()) -> str | None:
    """A shortest name matched by at least one glob of each group of ``all_of`` and by no glob
    of ``none_of``; None when there is none.

    A name without ``*``, ``?`` or ``[`` is a glob that matches itself only (:func:`literal`
    makes any name one)."""
    groups = [[_tokens(pattern) for pattern in group] for group in (*all_of, none_of)]
    alphabet = _alphabet(token for group in groups for tokens in group for token in tokens)
    start: _State = tuple(
        _closure(group, ((index, 0) for index in range(len(group)))) for group in groups
    )
    seen = {start}
    queue: deque[tuple[_State, str]] = deque([(start, "")])
    while queue:
        state, name = queue.popleft()
        if _found(groups, state):
            return name
        for char in alphabet:
            after = tuple(
                _step(group, positions, char)
                for group, positions in zip(groups, state, strict=True)
            )
            if after in seen or not all(after[:-1]) or _matches_all_after(groups[-1], after[-1]):
                continue
            if len(seen) >= _MAX_STATES:
                return None
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


def _takes(token: _Token, char: str) -> bool:
    if token in (_STAR, _ANY):
        return True
    if len(token) == 1:
        return char == token
    # A class: fnmatch itself says what it holds (ranges, negation, empty ranges).
    return fnmatch.fnmatchcase(char, token)


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


def _closure(
    group: Sequence[tuple[_Token, ...]], positions: Iterable[_Position]
) -> frozenset[_Position]:
    """``positions`` and those a ``*`` reaches by matching nothing."""
    closed: set[_Position] = set()
    for index, at in positions:
        tokens = group[index]
        closed.add((index, at))
        while at < len(tokens) and tokens[at] == _STAR:
            at += 1
            closed.add((index, at))
    return frozenset(closed)


def _step(
    group: Sequence[tuple[_Token, ...]], positions: frozenset[_Position], char: str
) -> frozenset[_Position]:
    moved: list[_Position] = []
    for index, at in positions:
        tokens = group[index]
        if at < len(tokens) and _takes(tokens[at], char):
            moved.append((index, at if tokens[at] == _STAR else at + 1))
    return _closure(group, moved)


def _accepts(group: Sequence[tuple[_Token, ...]], positions: frozenset[_Position]) -> bool:
    return any(at == len(group[index]) for index, at in positions)


def _matches_all_after(
    group: Sequence[tuple[_Token, ...]], positions: frozenset[_Position]
) -> bool:
    """Whether every continuation is matched (a glob is at its trailing ``*``): nothing to find
    past here."""
    # Runs of * are one token, so a trailing * is the last token.
    return any(at == len(group[index]) - 1 and group[index][at] == _STAR for index, at in positions)


def _found(groups: Sequence[Sequence[tuple[_Token, ...]]], state: _State) -> bool:
    *wanted, unwanted = zip(groups, state, strict=True)
    return all(_accepts(*each) for each in wanted) and not _accepts(*unwanted)
