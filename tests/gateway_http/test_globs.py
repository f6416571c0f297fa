"""The name search behind the backends file's glob-key check: it must read a glob exactly as
routing does (:func:`fnmatch.fnmatchcase`), or a good file is refused and a bad one accepted."""

from __future__ import annotations

import fnmatch
import itertools
import random

import pytest

from gateway_http.upstream.globs import example, literal


@pytest.mark.parametrize(
    ("all_of", "none_of", "expected"),
    [
        ([["claude-*"], ["claude-*"]], ["claude-*"], None),
        ([["claude-*"], ["claude-*"]], ["*"], None),
        ([["claude-*"], ["claude-*"]], ["gpt-*"], "claude-"),
        # Every Claude model but the version-3 ones, and those: all of them.
        ([["claude-*"]], ["claude-3*", "claude-[!3]*"], "claude-"),
        ([["claude-?*"]], ["claude-3*", "claude-[!3]*"], None),
        ([["m-[a-c]"]], ["m-a", "m-c"], "m-b"),
        ([["m-[!a-c]"]], ["m-?"], None),
        # An empty range matches nothing, a [ never closed is itself.
        ([["m-[c-a]"]], [], None),
        ([["m[1"]], ["m1"], "m[1"),
        # Two groups: a name both match.
        ([["gpt-*"], ["gpt-4o", "gpt-4o-mini", "o*"]], ["gpt-4o"], "gpt-4o-mini"),
        ([["gpt-*"], ["o*"]], [], None),
    ],
)
def test_a_name_matching_all_groups_and_not_the_rest(
    all_of: list[list[str]], none_of: list[str], expected: str | None
) -> None:
    assert example(all_of, none_of) == expected


def test_a_literal_matches_its_name_only() -> None:
    for name in ("gpt-4o", "a*b", "x[y]?", "[!a]"):
        # It matches the name, and there is no other.
        assert example([[literal(name)]]) == name
        assert example([[literal(name)]], [literal(name)]) is None


def test_it_agrees_with_fnmatch_on_random_globs() -> None:
    rng = random.Random(35)
    atoms = ["a", "b", "-", "*", "?", "[ab]", "[!a]", "[a-b]", "[b-a]", "[", "]", "[!]", "[]a]"]
    words = ["".join(w) for n in range(5) for w in itertools.product("ab-[]x", repeat=n)]
    matched: dict[str, set[str]] = {}

    def matching(glob: str) -> set[str]:
        if glob not in matched:
            matched[glob] = {word for word in words if fnmatch.fnmatchcase(word, glob)}
        return matched[glob]

    def glob() -> str:
        return "".join(rng.choice(atoms) for _ in range(rng.randint(0, 3)))

    for _ in range(400):
        all_of = [[glob() for _ in range(rng.randint(1, 2))] for _ in range(rng.randint(1, 2))]
        none_of = [glob() for _ in range(rng.randint(0, 3))]
        wanted = set(words)
        for group in all_of:
            wanted &= set().union(*map(matching, group))
        wanted -= set().union(*map(matching, none_of))
        found = example(all_of, none_of)
        context = (all_of, none_of, found)
        if found is None:
            assert not wanted, context
        else:
            # A name that truly is one, and a shortest one.
            assert all(any(fnmatch.fnmatchcase(found, g) for g in group) for group in all_of)
            assert not any(fnmatch.fnmatchcase(found, g) for g in none_of), context
            assert all(len(found) <= len(word) for word in wanted), context
