"""The relevance floor: when nothing stored is about the question, a recall returns nothing.

A ranking always has a best match, even for "What's the capital of Peru?" asked of someone's
chat memories; injecting it would put unrelated text in front of the model. A recall therefore
returns nothing when

- most of what the question **names** (more than half of its capitalised words inside a
  sentence, as "Peru" or "Caroline"; not months or weekdays) no memory of the recall's scope
  holds: it asks about someone or something this memory never heard of; or
- in the ``hybrid`` ranking, no candidate is close in meaning (best cosine under
  :data:`MIN_COSINE`) **and** no memory holds much of the question's words (the best match by
  its own words or its context covers under :data:`MIN_COVERAGE` of the question's IDF,
  :meth:`~arona_store.lexical.LexicalRanker.matches`). A question about no one (no word of
  the first person, "I", "my", "we"... or "mein", "mon", "mi"..., and no name this memory
  holds: "When may a chess player castle?", "who sang i want to dance with somebody") asks
  about the world rather than the user; a memory is injected for it only when it is clearly
  about the same thing (best cosine :data:`IMPERSONAL_MIN_COSINE`).

Measured with ``bench/recall_locomo.py`` (its "unrelated" rows): LoCoMo questions asked of
another conversation's memories, hand-written off-topic questions and, with ``--unrelated``,
public questions people asked a search engine (Natural Questions).
"""

from __future__ import annotations

import re

from arona_store.retrieval import WordIndex

MIN_COSINE = 0.3
MIN_COVERAGE = 0.5
IMPERSONAL_MIN_COSINE = 0.45

# Words of the first person in the languages written with spaces that users of the gateway
# most often write in (English, German, French, Spanish, Italian, Portuguese, Dutch), so a
# question in one of them about its writer keeps the floor of MIN_COSINE.
_FIRST_PERSON = frozenset(
    """
    i me my mine myself we us our ours ourselves
    ich mich mir mein meine meinen meinem meiner meines wir uns unser unsere unseren unserem
    je j m moi mon ma mes nous notre nos
    yo mi mis conmigo nosotros nosotras nuestro nuestra nuestros nuestras
    io mio mia miei mie noi nostro nostra nostri nostre
    eu meu minha meus minhas comigo nós nosso nossa nossos nossas
    ik mij mijn wij ons onze
    """.split()
)
_WORDS = re.compile(r"\w+")

_CAPITALISED = re.compile(r"\b[A-Z][a-z]+\b")
_NOT_NAMES = frozenset(
    """
    january february march april may june july august september october november december
    monday tuesday wednesday thursday friday saturday sunday i
    """.split()
)


def names(text: str) -> list[str]:
    """The capitalised words of ``text`` that do not start a sentence, lower-cased."""
    found = []
    for match in _CAPITALISED.finditer(text):
        before = text[: match.start()].rstrip()
        word = match.group().lower()
        if before and before[-1] not in ".!?\"'" and word not in _NOT_NAMES:
            found.append(word)
    return list(dict.fromkeys(found))


def names_held(words: WordIndex, text: str, node_type: str | None) -> tuple[int, int]:
    """How many of the names of ``text`` (:func:`names`) some memory (of ``node_type``) holds,
    and how many none does (read transaction open)."""
    held = unknown = 0
    for name in names(text):
        if words.holds(name, node_type):
            held += 1
        else:
            unknown += 1
    return held, unknown


def names_unknown(held: int, unknown: int) -> bool:
    """Whether most of what a question names (more than half) is held by no memory: a
    question naming one stranger beside someone this memory knows ("Which city have both
    Jean and John visited?", or a typo, "Andew") is still answered."""
    return unknown > held


def first_person(text: str) -> bool:
    """Whether ``text`` speaks of its writer ("I", "my", "we"...)."""
    return any(word in _FIRST_PERSON for word in _WORDS.findall(text.lower()))


def far(best_cosine: float, coverage: float, personal: bool = True) -> bool:
    """Whether a hybrid recall's candidates are all too far from the question to inject;
    ``personal``: whether the question speaks of its writer or names someone this memory
    knows (module docstring)."""
    if coverage >= MIN_COVERAGE:
        return False
    return best_cosine < (MIN_COSINE if personal else IMPERSONAL_MIN_COSINE)
