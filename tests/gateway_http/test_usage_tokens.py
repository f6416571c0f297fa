"""The gateway's own token counts (cl100k_base): a prompt as OpenAI counts it, and a memory
section counted a memory at a time yet exactly as the whole section would be."""

from __future__ import annotations

import random

from arona_grpc.philia import PhiliaMemory
from arona_grpc.service import render_section
from gateway_http.usage.tokens import TokenCounter

# Texts that test where cl100k_base cuts: punctuation before a newline, trailing spaces,
# blank and indented lines, a memory that starts with punctuation or a bracket, numbers,
# CJK, emoji, tabs, markdown of its own.
PIECES = [
    "I prefer oolong tea.",
    "User: where do I live?\nAssistant: In Lyon.",
    "- [0.99] not a bullet of ours",
    "] starts with a bracket",
    "(aside) and 12345 numbers 3.14159",
    "line with trailing spaces   \n\n\nafter blank lines",
    "東京に住んでいます。日本語のメモ",
    "emoji 🍵🍵 and tabs\tinside",
    "## a heading of its own\n# and another",
    "ends with punctuation!!!\n",
    "mixed: café, naïve, Straße; «quotes»",
    "a" * 300,
    "...",
]


def test_a_prompt_is_counted_as_openai_counts_it() -> None:
    counter = TokenCounter()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hello world", "name": "alice"},
    ]
    # 3 per message, each role and content, a name and its 1, and 3 for the reply.
    expected = (
        3
        + (3 + counter.count("system") + counter.count("You are terse."))
        + (3 + counter.count("user") + counter.count("hello world") + 1 + counter.count("alice"))
    )
    assert counter.prompt(messages) == expected
    assert counter.count("hello world") == 2
    assert counter.prompt([{"role": "user", "content": "hello world"}]) == 9


def test_a_section_counted_a_memory_at_a_time_equals_the_whole_count() -> None:
    counter = TokenCounter()
    rng = random.Random(20261202)
    for _ in range(300):
        memories = [
            PhiliaMemory(
                "".join(rng.choice(PIECES) + rng.choice(["", " ", "\n", ". "]) for _ in range(3)),
                rng.random(),
                "episode",
            )
            for _ in range(rng.randint(1, 6))
        ]
        section = render_section(memories)
        whole = 3 + counter.count("system") + counter.count(section)
        assert counter.section(section) == whole, section
        # Counted again (from the remembered parts): the same.
        assert counter.section(section) == whole


def test_a_text_that_is_not_a_rendered_section_is_counted_whole() -> None:
    counter = TokenCounter()
    odd = "## Relevant Long-Term Memories\n- [0.5]no space after the score"
    assert counter.section(odd) == 3 + counter.count("system") + counter.count(odd)
    assert counter.section("") == 0
