"""The LoCoMo recall benchmark, run for real on a small LoCoMo-shaped sample made here (none of
LoCoMo's text): the gateway started as ``make run`` starts it, every turn written back and
every question asked through gRPC."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import locomo_data

ROOT = Path(__file__).resolve().parents[2]

# (speaker, text) per session; each question's evidence shares rare words with it alone.
SESSIONS = {
    "alpha": [
        [
            ("Ada", "Hi Ben! I finally adopted a greyhound called Pixel last weekend."),
            ("Ben", "Congratulations! I spent Saturday repairing my old sailboat hull."),
            ("Ada", "My sister Wilma moved to Reykjavik for a glaciology post."),
            ("Ben", "Wow. I am reading a novel about lighthouse keepers."),
        ],
        [
            ("Ada", "Pixel learned to fetch frisbees in the park."),
            ("Ben", "I entered the sailboat in the harbour regatta and came third."),
            ("Ada", "I started pottery classes on Thursday evenings."),
            ("Ben", "Nice! My daughter Juno plays the bassoon now."),
        ],
    ],
    "beta": [
        [
            ("Cleo", "I brewed my first batch of elderflower cordial."),
            ("Dev", "I got promoted to lead the telescope maintenance crew."),
            ("Cleo", "My grandmother taught me to knit mittens."),
        ],
        [
            ("Dev", "The telescope mirror needed recoating in Chile."),
            ("Cleo", "I sold forty bottles of cordial at the farmers market."),
            ("Dev", "I am training for a marathon in Lisbon."),
        ],
    ],
}
DATES = ["1:56 pm on 8 May, 2023", "10:37 am on 27 June, 2023"]
QUESTIONS = {
    "alpha": [
        ("What is the name of Ada's greyhound?", 4, ["D1:1"]),
        ("Where did Wilma move for glaciology?", 4, ["D1:3"]),
        ("When did Ben race the sailboat in the regatta?", 2, ["D2:2"]),
        ("What does Pixel fetch, and which dog is it?", 1, ["D2:1; D1:1"]),
        ("Would Ben enjoy a book about lighthouses?", 3, ["D1:04"]),
        ("What did Ada say about quantum chess?", 5, ["D1:1"]),  # adversarial: not asked
        ("What instrument does Juno play?", 4, []),  # no evidence named: not asked
    ],
    "beta": [
        ("What cordial did Cleo brew?", 4, ["D1:1"]),
        ("Where was the telescope mirror recoated?", 2, ["D:2:1"]),
        ("Which city hosts Dev's marathon?", 4, ["D2:3"]),
    ],
}


def sample() -> list[dict[str, Any]]:
    """Two conversations in LoCoMo's layout."""
    out = []
    for name, sessions in SESSIONS.items():
        conversation: dict[str, Any] = {"speaker_a": sessions[0][0][0], "speaker_b": "x"}
        for s, turns in enumerate(sessions, start=1):
            conversation[f"session_{s}_date_time"] = DATES[s - 1]
            conversation[f"session_{s}"] = [
                {"speaker": who, "dia_id": f"D{s}:{i}", "text": text}
                for i, (who, text) in enumerate(turns, start=1)
            ]
        conversation["session_1"][1]["blip_caption"] = "a photo of a boat on a beach"
        qa = [
            {"question": q, "answer": "-", "evidence": ev, "category": c}
            for q, c, ev in QUESTIONS[name]
        ]
        out.append({"sample_id": f"conv-{name}", "conversation": conversation, "qa": qa})
    return out


def _bench(*args: str, timeout: float = 540) -> subprocess.CompletedProcess[str]:
    """``python -m bench.recall_locomo ARGS``, run from the project's root."""
    return subprocess.run(
        [sys.executable, "-m", "bench.recall_locomo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _rows(section: str) -> dict[str, list[str]]:
    """A report section's table: its first cell -> the others."""
    return {
        cells[0]: cells[1:]
        for line in section.splitlines()
        if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])
    }


def test_the_sample_is_read_as_locomo_is(tmp_path: Path) -> None:
    path = tmp_path / "sample.json"
    path.write_text(json.dumps(sample()))
    alpha, beta = locomo_data.load(path)
    assert [t.dia_id for t in alpha.turns][:5] == ["D1:1", "D1:2", "D1:3", "D1:4", "D2:1"]
    assert alpha.turns[1].text == (
        "Ben: Congratulations! I spent Saturday repairing my old sailboat hull."
        " [shares a photo of a boat on a beach]"
    )
    # Categories 1-4 with evidence only; LoCoMo's typos in dialog ids are read as meant.
    assert [q.evidence for q in alpha.questions] == [
        ("D1:1",),
        ("D1:3",),
        ("D2:2",),
        ("D2:1", "D1:1"),
        ("D1:4",),
    ]
    assert beta.questions[1].evidence == ("D2:1",)
    # Dated: sessions keep their spacing, the last one ending a day before the questions.
    times = locomo_data.turn_times(alpha, asked_at=1_800_000_000.0)
    assert (times["D2:1"] - times["D1:1"]).days == 49
    assert times["D2:4"].timestamp() == 1_800_000_000.0 - 86400


# Questions about the world, in the shape of the public set the benchmark reads (written here).
PUBLIC = [
    "how many moons does jupiter have",
    "who painted the ceiling of the sistine chapel",
    "what is the boiling point of nitrogen",
    "when was the first transatlantic telegraph cable laid",
    "who wrote the opera la traviata",
    "what is the largest desert in asia",
]


def test_public_questions_are_read_and_a_bad_line_is_named(tmp_path: Path) -> None:
    good = tmp_path / "public.jsonl"
    good.write_text(
        "\n".join(json.dumps({"question": q, "answer": ["-"]}) for q in PUBLIC) + "\n\n"
    )
    assert locomo_data.load_public(good) == PUBLIC
    path = tmp_path / "sample.json"
    path.write_text(json.dumps(sample()))
    conversations = locomo_data.load(path)
    # Each conversation gets every other question: none is asked of both.
    asked = [
        [
            text
            for kind, text in locomo_data.unrelated_questions(conversations, i, PUBLIC)
            if kind == "public"
        ]
        for i in range(2)
    ]
    assert asked == [PUBLIC[0::2], PUBLIC[1::2]]
    for line, reason in (("{not json", "not JSON"), ('{"q": "x"}', 'no "question" string')):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"question": "fine"}) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=f"line 2: {reason}"):
            locomo_data.load_public(bad)


@pytest.mark.timeout(600)
def test_the_benchmark_runs_through_the_gateway(tmp_path: Path) -> None:
    data = tmp_path / "sample.json"
    data.write_text(json.dumps(sample()))
    public = tmp_path / "public.jsonl"
    public.write_text("".join(json.dumps({"question": q}) + "\n" for q in PUBLIC))
    out = tmp_path / "locomo.md"
    done = _bench("--data", str(data), "--out", str(out), "--quiet", "--unrelated", str(public))
    assert done.returncode == 0, done.stderr
    report = out.read_text()
    assert report == done.stdout
    for condition in ("undated", "dated"):
        section = report.split(f"## {condition}\n", 1)[1].split("\n## ", 1)[0]
        rows = _rows(section)
        # 8 questions asked (no adversarial one, none without evidence), each answered by
        # the turn holding its rare words: every evidence turn among the first ten.
        assert rows["**1-4**"][0] == "8"
        assert float(rows["**1-4**"][3]) == 100.0  # R@10
        assert float(rows["4 single-hop"][1]) >= 50.0  # R@1
        assert "recall through gRPC: p50" in section
        assert "matched no dialog turn" not in section
        # The other conversation's questions (about people never mentioned) inject nothing,
        # and nearly every off-topic and public one too.
        assert "(other conversation) injecting nothing: 8 of 8 (100.0 %)" in section
        public_empty = re.search(r"\(public\) injecting nothing: (\d+) of 6 ", section)
        assert public_empty is not None and int(public_empty.group(1)) >= 5
        unrelated = re.search(r"\*\*unrelated questions injecting nothing: (\d+) of 54", section)
        assert unrelated is not None and int(unrelated.group(1)) >= 50
        assert "related questions injecting nothing: 0 of 8" in section


def test_buried_under_newer_memories_each_conversation_is_still_found(tmp_path: Path) -> None:
    # --buried: each conversation written, in shared mode, before 300 newer benchmark episodes
    # and asked of the whole store; the sample's questions name words only their evidence
    # holds, so every evidence turn is still among the first ten, though older than all else.
    data = tmp_path / "sample.json"
    data.write_text(json.dumps(sample()))
    done = _bench("--data", str(data), "--buried", "300")
    assert done.returncode == 0, done.stderr
    report = done.stdout
    assert "no scope." in report
    section = report.split("## buried under 300 newer memories\n", 1)[1]
    rows = _rows(section)
    assert rows["**1-4**"][0] == "8"
    assert float(rows["**1-4**"][3]) == 100.0  # R@10
    assert "matched no dialog turn" not in section
    refused = _bench("--data", str(data), "--buried", "0", timeout=60)
    assert refused.returncode == 2
    assert "--buried: a number of episodes, at least 1" in refused.stderr
