"""LoCoMo as the benchmark reads it (``data/locomo10.json`` of snap-research/LoCoMo, read from a
path, never committed): its conversations, turns and questions with their evidence, the date of
each turn, the text a turn is stored as, and the questions no memory answers (another
conversation's, off-topic ones, a public set's)."""

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from arona_grpc.service import ELLIPSIS, episode_text

SCOPE_PREFIX = "locomo/"
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
# A dialog id as LoCoMo writes it, tolerating its few typos ("D:11:26", "D30:05").
_DIA_ID = re.compile(r"D:?(\d+):0*(\d+)")
_SESSION_DATE = "%I:%M %p on %d %B, %Y"


@dataclass(frozen=True)
class Turn:
    dia_id: str
    session: int
    text: str  # what is written back as the user's side of the turn


@dataclass(frozen=True)
class Question:
    text: str
    category: int
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class Conversation:
    name: str
    turns: tuple[Turn, ...]
    questions: tuple[Question, ...]
    sessions: dict[int, datetime]

    @property
    def scope(self) -> str:
        return SCOPE_PREFIX + self.name


@dataclass
class Answer:
    """One question's outcome: the dialog ids of each recalled memory, in order."""

    conversation: int  # index in the file
    question: Question
    recalled: list[frozenset[str]]
    elapsed_ms: float


@dataclass
class Run:
    condition: str
    grpc: bool
    answers: list[Answer] = field(default_factory=list)
    # (kind, memories injected) of each unrelated question asked
    unrelated: list[tuple[str, int]] = field(default_factory=list)
    write_s: float = 0.0
    # Through gRPC: from the last turn written until the store had every turn's vector.
    embed_wait_s: float = 0.0
    unmapped: int = 0  # recalled memories whose text matched no turn


def load(path: Path) -> list[Conversation]:
    """The conversations of a LoCoMo file, with their questions of categories 1-4 that name
    evidence."""
    data = json.loads(path.read_text(encoding="utf-8"))
    conversations = []
    for sample in data:
        conv = sample["conversation"]
        turns: list[Turn] = []
        sessions: dict[int, datetime] = {}
        number = 1
        while f"session_{number}" in conv:
            sessions[number] = datetime.strptime(
                conv[f"session_{number}_date_time"], _SESSION_DATE
            ).replace(tzinfo=UTC)
            for turn in conv[f"session_{number}"]:
                turns.append(Turn(_dia_id(turn["dia_id"]), number, turn_text(turn)))
            number += 1
        questions = []
        for qa in sample["qa"]:
            evidence = tuple(
                dict.fromkeys(
                    f"D{m.group(1)}:{m.group(2)}"
                    for item in qa.get("evidence", [])
                    for m in _DIA_ID.finditer(str(item))
                )
            )
            if qa.get("category") in CATEGORIES and evidence:
                questions.append(Question(str(qa["question"]), int(qa["category"]), evidence))
        conversations.append(
            Conversation(str(sample["sample_id"]), tuple(turns), tuple(questions), sessions)
        )
    return conversations


def _dia_id(raw: str) -> str:
    found = _DIA_ID.search(raw)
    if found is None:
        raise ValueError(f"not a dialog id: {raw!r}")
    return f"D{found.group(1)}:{found.group(2)}"


def turn_text(turn: dict[str, Any]) -> str:
    """A dialog turn as written back: ``<speaker>: <text>``, and the caption of a photo."""
    text = f"{turn['speaker']}: {turn['text'].strip()}"
    caption = turn.get("blip_caption")
    if caption:
        text += f" [shares {caption}]"
    return text


def turn_times(conversation: Conversation, asked_at: float) -> dict[str, datetime]:
    """Each turn's time in the dated condition: its session's, every session moved by the
    same amount so that the last one ended a day before ``asked_at``."""
    last = max(conversation.sessions.values())
    shift = datetime.fromtimestamp(asked_at, UTC) - timedelta(days=1) - last
    return {turn.dia_id: conversation.sessions[turn.session] + shift for turn in conversation.turns}


class TextMap:
    """Stored memory text -> the dialog ids it holds (identical turns are one memory)."""

    def __init__(self, conversation: Conversation) -> None:
        self._ids: dict[str, set[str]] = {}
        for turn in conversation.turns:
            self._ids.setdefault(stored_text(turn), set()).add(turn.dia_id)

    def ids(self, text: str) -> frozenset[str] | None:
        found = self._ids.get(text)
        if found is None and text.endswith(ELLIPSIS):
            # Cut by the gateway's cap on one memory's length.
            prefix = text[: -len(ELLIPSIS)]
            found = {
                i for stored, ids in self._ids.items() if stored.startswith(prefix) for i in ids
            }
        return frozenset(found) if found else None


def stored_text(turn: Turn) -> str:
    """The episode the gateway stores for a turn written back as the user's side."""
    return episode_text(turn.text, "")


# Questions nobody's chat memory answers, asked of every conversation (written for this
# benchmark).
OFF_TOPIC = (
    "What's the capital of Peru?",
    "How do I bake sourdough bread?",
    "What is the boiling point of water at sea level?",
    "Can you recommend a laptop for programming?",
    "How many moons does Jupiter have?",
    "Will it rain in Oslo tomorrow?",
    "Translate 'good morning' into Italian.",
    "What is a Python decorator?",
    "Who won the 1998 football world cup?",
    "How do I reset my wifi router?",
    "What's a good recipe for pad thai?",
    "Explain quantum entanglement simply.",
    "How tall is Mount Everest?",
    "What time zone is Tokyo in?",
    "How do I change a flat tire?",
    "What is the GDP of Germany?",
    "Write a haiku about the sea.",
    "How do vaccines train the immune system?",
    "When may a chess player castle?",
    "How do I convert Celsius to Fahrenheit?",
)
# Questions of the next conversation asked of each one.
CROSS_QUESTIONS = 20
# Public questions (--unrelated) asked of each conversation, none asked of two.
PUBLIC_QUESTIONS = 100
UNRELATED_KINDS = ("other conversation", "off-topic", "public")


def load_public(path: Path) -> list[str]:
    """The questions of a JSON Lines file of objects with a ``"question"`` string (Natural
    Questions' ``NQ-open.dev.jsonl``); blank lines are skipped."""
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {number}: not JSON ({exc.msg})") from None
        question = item.get("question") if isinstance(item, dict) else None
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f'{path} line {number}: no "question" string')
        questions.append(question)
    return questions


def unrelated_questions(
    conversations: Sequence[Conversation], index: int, public: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """The unrelated questions asked of conversation ``index``: the first
    :data:`CROSS_QUESTIONS` of the next conversation (about other people), the off-topic
    ones and up to :data:`PUBLIC_QUESTIONS` of the ``public`` ones (every n-th, n the number
    of conversations, from the index-th on), as (kind, text)."""
    mine = [("public", q) for q in public[index :: len(conversations)][:PUBLIC_QUESTIONS]]
    if len(conversations) < 2:
        return [("off-topic", q) for q in OFF_TOPIC] + mine
    other = conversations[(index + 1) % len(conversations)]
    cross = [("other conversation", q.text) for q in other.questions[:CROSS_QUESTIONS]]
    return cross + [("off-topic", q) for q in OFF_TOPIC] + mine
