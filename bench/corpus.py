"""A deterministic, varied corpus of chat episodes and the recall queries that match it.

Episodes read like what the gateway writes back (``User: …\\nAssistant: …``): facts about
preferences, places, people, pets, work and plans, with names, numbers and dates drawn from a
seeded RNG so every run loads the same store without downloading anything. Each query shares
topic words with many episodes, so memory-enabled turns really recall something.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

SEED = 20260101

_NAMES = (
    "Alice Bruno Chiara Dmitri Elena Farid Greta Hiro Ines Jonas Keiko Lars Mira Nadia Omar "
    "Priya Quentin Rosa Sven Tomas Uma Viktor Wen Ximena Yusuf Zoe"
).split()
_CITIES = (
    "Lyon Porto Kyoto Oslo Austin Lima Tallinn Seville Dublin Hanoi Graz Bergen Quebec Cusco "
    "Lisbon Nagoya Zagreb Krakow Bologna Utrecht"
).split()
_DRINKS = "oolong sencha matcha espresso cortado chai rooibos genmaicha darjeeling".split()
_FOODS = "ramen risotto pho tacos dumplings paella falafel curry gnocchi bibimbap".split()
_PETS = "dog cat parrot rabbit tortoise hamster ferret goldfish".split()
_HOBBIES = (
    "bouldering chess sailing pottery birdwatching cycling gardening photography violin "
    "woodworking astronomy knitting"
).split()
_LANGS = "Rust Python Go Haskell Kotlin Elixir TypeScript Zig OCaml Julia".split()
_MONTHS = (
    "January February March April May June July August September October November December"
).split()
_PROJECTS = "billing search onboarding telemetry checkout scheduler ledger gateway".split()

_TEMPLATES = (
    (
        "I prefer {drink} tea in the {part} and never after {hour} pm.",
        "Noted: {drink} in the {part}, nothing after {hour} pm.",
    ),
    (
        "I moved to {city} in {month} {year} for a new job.",
        "Got it, you live in {city} since {month} {year}.",
    ),
    (
        "My {pet} is called {name} and is {age} years old.",
        "{name} the {pet}, {age} years old. I will remember.",
    ),
    (
        "I have been doing {hobby} every {day} for {age} years.",
        "So {hobby} on {day}s is a long habit of yours.",
    ),
    (
        "At work I write {lang} on the {project} service with {name}.",
        "You work on {project} in {lang}, together with {name}.",
    ),
    (
        "My favourite dinner is {food}, ideally in {city}.",
        "{food} is your favourite dinner; {city} is the place for it.",
    ),
    (
        "Remind me that the {project} review with {name} is on {month} {dom}.",
        "The {project} review with {name} is on {month} {dom}.",
    ),
    (
        "I am allergic to {food2} but I love {food}.",
        "No {food2} for you; {food} is fine.",
    ),
    (
        "We plan a trip to {city} in {month} to go {hobby}.",
        "A {hobby} trip to {city} in {month}, noted.",
    ),
    (
        "My sister {name} is learning {lang} and asks me about the {project} code.",
        "Your sister {name} learns {lang}; you help her with {project}.",
    ),
)

QUERIES = (
    "which tea do I prefer in the morning",
    "where did I move for my new job",
    "what is my dog called",
    "tell me about my cat",
    "how long have I been bouldering",
    "which language do I write at work",
    "what is my favourite dinner",
    "when is the billing review",
    "what am I allergic to",
    "where do we plan a trip to go sailing",
    "what is my sister learning",
    "do I drink espresso after dinner",
    "what do I know about the telemetry service",
    "which city has the best ramen",
    "what does my parrot eat",
    "when did I move to Kyoto",
    "who works with me on the checkout service",
    "what hobby do I do on Sundays",
    "remind me about the scheduler review",
    "which tea do I drink in the afternoon",
)


def _fields(rng: random.Random) -> dict[str, object]:
    return {
        "name": rng.choice(_NAMES),
        "city": rng.choice(_CITIES),
        "drink": rng.choice(_DRINKS),
        "food": rng.choice(_FOODS),
        "food2": rng.choice(_FOODS),
        "pet": rng.choice(_PETS),
        "hobby": rng.choice(_HOBBIES),
        "lang": rng.choice(_LANGS),
        "month": rng.choice(_MONTHS),
        "project": rng.choice(_PROJECTS),
        "part": rng.choice(("morning", "afternoon", "evening")),
        "day": rng.choice(("Monday", "Wednesday", "Friday", "Saturday", "Sunday")),
        "hour": rng.randint(2, 9),
        "age": rng.randint(1, 15),
        "year": rng.randint(2012, 2025),
        "dom": rng.randint(1, 28),
    }


def episodes(count: int, seed: int = SEED) -> Iterator[str]:
    """``count`` varied episodes, the same ones for the same ``seed``."""
    rng = random.Random(seed)
    for _ in range(count):
        user, assistant = rng.choice(_TEMPLATES)
        fields = _fields(rng)
        yield f"User: {user.format(**fields)}\nAssistant: {assistant.format(**fields)}"
