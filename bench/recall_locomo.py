"""Recall measured on LoCoMo, through the gateway's gRPC ``MemoryService``.

LoCoMo (Maharana et al., ACL 2024) is 10 long conversations between two people (5,882 dialog
turns over up to 35 sessions months apart) with questions whose evidence turns are named
(``"D1:3"``: session 1, turn 3). Its file is not in this repository (licence CC BY-NC 4.0):
get ``data/locomo10.json`` from the public LoCoMo repository (github.com/snap-research/locomo)
and pass its path::

    python -m bench.recall_locomo --data PATH/locomo10.json [--out bench/results/locomo.md]

What it does, for each of two conditions:

- starts the stack as ``make run`` does (``arona-gateway up``: the embedded store with its
  default ranking, ``hybrid`` when the semantic extra is installed, and the gRPC service), in a
  fresh data folder, with ``ARONA_MEMORY_SCOPE=user`` so each conversation is a scope of its
  own (``locomo/<sample id>``): a scope recalls only its own episodes, as two users of one
  gateway would;
- writes every dialog turn back through gRPC ``Writeback`` (``user`` = ``"<speaker>: <text>"``,
  plus ``[shares <photo caption>]`` for a shared photo; nothing as ``assistant``), in order,
  conversations side by side, then waits until the store has every turn's vector (the hybrid
  store embeds them after answering; the questions measure the ranking, not that wait);
- asks each question of categories 1-4 with evidence (1,536) through gRPC ``Recall`` (limit
  10, the conversation's scope), one at a time, timing each call;
- maps each recalled memory back to its dialog turn(s) by its text.

The conditions: **undated** (every turn written now) and **dated** (each turn's
``WritebackRequest.occurred_at`` is its session's date, the sessions shifted together so that
the last one ended a day before the questions are asked).

Figures: evidence recall R@k (the share of a question's evidence turns among the first k
memories, averaged) and hit@k (at least one evidence turn among the first k), per category
(LoCoMo's numbering: 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop) and over
categories 1-4, for all ten conversations and for each half (conversations 1-5, on which the
store's settings were chosen, and 6-10); and the recall's p50 and p99 as the client sees it.

Unrelated questions, asked of each conversation's scope the same way: the first 20 questions of
the next conversation (about other people), 20 off-topic ones written for this benchmark and,
with ``--unrelated PATH``, 100 public questions people asked a search engine (Natural
Questions' open-domain dev set: ``nq_open/NQ-open.dev.jsonl`` of
github.com/google-research-datasets/natural-questions, CC BY-SA 3.0; not in this repository
either), no public question asked of two conversations. The report counts those that inject
nothing, per kind and in all.

``--ranking lexical`` runs the store's lexical ranking instead (its own row), and ``--direct``
skips the gateway: the same texts and scopes written to and asked of a store opened in this
process (for trying store settings quickly; figures of record go through gRPC).

``--buried N`` asks what a large shared store does to it, in this process: each conversation
is written, on its own, into a copy of a store of N of the speed benchmark's episodes
(``bench.corpus``, written over the last 90 days), as the default (``shared``) mode writes
memories (one type, no scope), its sessions dated so that the last one ended
:data:`BURIED_DAYS` days before the questions: every one of its turns is older than every
other memory, the hardest case for a ranking that reads the newest matches first. Its
questions are asked of the whole store.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from arona_grpc.scopes import scope_id, scoped_node_type
from bench.loadgen import percentile
from bench.locomo_data import (
    CATEGORIES,
    PUBLIC_QUESTIONS,
    UNRELATED_KINDS,
    Answer,
    Conversation,
    Run,
    TextMap,
    load,
    load_public,
    stored_text,
    turn_times,
    unrelated_questions,
)
from bench.procs import Proc, clean_env

ROOT = Path(__file__).resolve().parents[1]
KS = (1, 5, 10)
LIMIT = 10
# The conversations settings were chosen on (the first five of the file); the others are
# held out.
TUNING_HALF = 5
CONDITIONS = ("undated", "dated")
# Turns written at once (one conversation each: a conversation's turns go in order).
WRITERS = 4
STARTUP_S = 120.0
# How long the store may take to embed every written turn (about a minute for 5,882).
EMBED_MAX_S = 900.0
# --buried: how long before the questions a conversation's last session ended (the benchmark
# episodes it is buried under were written over the last 90 days).
BURIED_DAYS = 100


# -- scoring -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scores:
    questions: int
    recall: dict[int, float]  # k -> mean evidence recall at k, in percent
    hit: dict[int, float]  # k -> share of questions with an evidence turn in the first k


def score(answers: Iterable[Answer]) -> Scores:
    recall = {k: 0.0 for k in KS}
    hit = {k: 0.0 for k in KS}
    n = 0
    for answer in answers:
        n += 1
        evidence = set(answer.question.evidence)
        for k in KS:
            found = set().union(*answer.recalled[:k]) & evidence
            recall[k] += len(found) / len(evidence)
            hit[k] += 1.0 if found else 0.0
    if n == 0:
        return Scores(0, {k: 0.0 for k in KS}, {k: 0.0 for k in KS})
    return Scores(
        n, {k: 100 * v / n for k, v in recall.items()}, {k: 100 * v / n for k, v in hit.items()}
    )


def table(run: Run) -> list[str]:
    """Per category and overall, for all conversations; then overall per half."""
    lines = [
        "| category | questions | R@1 | R@5 | R@10 | hit@1 | hit@5 | hit@10 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows: list[tuple[str, Scores]] = [
        (f"{c} {name}", score(a for a in run.answers if a.question.category == c))
        for c, name in CATEGORIES.items()
    ]
    rows.append(("**1-4**", score(run.answers)))
    rows.append(
        (
            f"1-4, conversations 1-{TUNING_HALF} (tuning)",
            score(a for a in run.answers if a.conversation < TUNING_HALF),
        )
    )
    rows.append(
        (
            f"1-4, conversations {TUNING_HALF + 1}-10 (held out)",
            score(a for a in run.answers if a.conversation >= TUNING_HALF),
        )
    )
    for label, s in rows:
        cells = [f"{s.recall[k]:.1f}" for k in KS] + [f"{s.hit[k]:.1f}" for k in KS]
        lines.append(f"| {label} | {s.questions} | " + " | ".join(cells) + " |")
    return lines


def unrelated_lines(run: Run) -> list[str]:
    """How often an unrelated question injected nothing, and a related one something."""
    lines = []
    for kind in UNRELATED_KINDS:
        asked = [n for k, n in run.unrelated if k == kind]
        if asked:
            empty = sum(1 for n in asked if n == 0)
            lines.append(
                f"unrelated questions ({kind}) injecting nothing: {empty} of {len(asked)}"
                f" ({100 * empty / len(asked):.1f} %)"
            )
    if run.unrelated:
        empty = sum(1 for _, n in run.unrelated if n == 0)
        lines.append(
            f"**unrelated questions injecting nothing: {empty} of {len(run.unrelated)}"
            f" ({100 * empty / len(run.unrelated):.1f} %)**"
        )
    related = sum(1 for a in run.answers if not a.recalled)
    lines.append(f"related questions injecting nothing: {related} of {len(run.answers)}")
    return lines


def latency_line(run: Run, via: str) -> str:
    times = sorted(a.elapsed_ms for a in run.answers)
    if not times:
        return "no recall"
    return (
        f"recall {via}: p50 {statistics.median(times):.1f} ms, p99"
        f" {percentile(times, 0.99):.1f} ms ({len(times)} calls, one at a time); turns written in"
        f" {run.write_s:.0f} s"
        + (f", their vectors stored {run.embed_wait_s:.0f} s later" if run.embed_wait_s else "")
    )


# -- through the gateway -----------------------------------------------------------------------


def wait_for_vectors(db: Path) -> None:
    """Return once every node of the store's database ``db`` has its vector (at once for a
    lexical store, which has no vectors table), polled; SystemExit after :data:`EMBED_MAX_S`."""
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA query_only=1")
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'vectors'").fetchone():
            return
        # A read transaction of its own each time: the store commits meanwhile.
        _until_embedded(
            lambda: int(
                conn.execute(
                    "SELECT count(*) FROM nodes n"
                    " WHERE NOT EXISTS (SELECT 1 FROM vectors v WHERE v.node_id = n.id)"
                ).fetchone()[0]
            )
        )


def wait_for_pg_vectors(url: str) -> None:
    """:func:`wait_for_vectors` for a store on PostgreSQL at ``url``."""
    from arona_store.pg.schema import connect

    with connect(url, autocommit=True) as conn:
        _until_embedded(
            lambda: int(
                conn.execute(
                    "SELECT count(*) FROM memory_nodes WHERE embedding IS NULL"
                ).fetchone()[0]
            )
        )


def _until_embedded(left: Callable[[], int]) -> None:
    """Poll ``left`` (how many turns have no vector yet) until none; SystemExit after
    :data:`EMBED_MAX_S`."""
    deadline = time.monotonic() + EMBED_MAX_S
    while (count := left()) > 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"{count} turns still without a vector after {EMBED_MAX_S:.0f} s")
        time.sleep(0.2)


@contextlib.contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """A new database on the PostgreSQL server at ``server_url`` (dropped after); its URL."""
    from bench.pg_scale import database

    with database(server_url, f"locomo_{os.getpid()}_{int(time.time() * 1000)}") as url:
        yield url


def start_stack(
    work: Path, ranking: str | None, database_url: str | None = None
) -> tuple[Proc, str]:
    """``arona-gateway up`` in a fresh data folder, users' memories kept apart (in
    PostgreSQL at ``database_url`` when given); its gRPC target."""
    env = {
        "ARONA_DATA_DIR": str(work / "data"),
        "ARONA_HTTP_PORT": "0",
        "ARONA_GRPC_PORT": "0",
        "ARONA_MEMORY_SCOPE": "user",
        "ARONA_LOG_LEVEL": "warning",
    }
    if ranking is not None:
        env["ARONA_STORE_RANKING"] = ranking
    if database_url is not None:
        env["ARONA_STORE_DATABASE_URL"] = database_url
    proc = Proc(
        "gateway",
        [sys.executable, "-m", "gateway_http.cli", "up"],
        work,
        env=clean_env(env),
        cwd=ROOT,
    )
    found = proc.wait_for(r"gRPC\s+(\S+:\d+)", STARTUP_S)
    return proc, found.group(1)


async def _grpc_run(
    conversations: Sequence[Conversation],
    target: str,
    condition: str,
    progress: bool,
    public: Sequence[str],
    wait_embedded: Callable[[], None],
) -> Run:
    import grpc
    from google.protobuf.timestamp_pb2 import Timestamp

    from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
    from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc

    run = Run(condition, grpc=True)
    asked_at = time.time()
    dated = condition == "dated"
    if dated and not dated_writebacks():
        raise SystemExit("the dated condition needs WritebackRequest.occurred_at")
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        gate = asyncio.Semaphore(WRITERS)

        async def write(conversation: Conversation) -> None:
            times = turn_times(conversation, asked_at) if dated else {}
            async with gate:
                for turn in conversation.turns:
                    request = pb.WritebackRequest(user=turn.text, scope=conversation.scope)
                    if dated:
                        stamp = Timestamp()
                        stamp.FromDatetime(times[turn.dia_id])
                        request.occurred_at.CopyFrom(stamp)
                    reply = await stub.Writeback(request, timeout=60)
                    if not reply.stored:
                        raise SystemExit(f"turn {turn.dia_id} of {conversation.name} not stored")

        started = time.perf_counter()
        await asyncio.gather(*(write(c) for c in conversations))
        run.write_s = time.perf_counter() - started
        await asyncio.to_thread(wait_embedded)
        run.embed_wait_s = time.perf_counter() - started - run.write_s
        for index, conversation in enumerate(conversations):
            texts = TextMap(conversation)
            for question in conversation.questions:
                began = time.perf_counter()
                reply = await stub.Recall(
                    pb.RecallRequest(query=question.text, limit=LIMIT, scope=conversation.scope),
                    timeout=60,
                )
                elapsed = (time.perf_counter() - began) * 1000
                if reply.state == pb.MEMORY_STATE_OFFLINE:
                    raise SystemExit(f"recall offline for {question.text!r}")
                run.answers.append(
                    Answer(
                        index,
                        question,
                        _recalled(texts, [m.text for m in reply.memories], run),
                        elapsed,
                    )
                )
            for kind, text in unrelated_questions(conversations, index, public):
                reply = await stub.Recall(
                    pb.RecallRequest(query=text, limit=LIMIT, scope=conversation.scope),
                    timeout=60,
                )
                if reply.state == pb.MEMORY_STATE_OFFLINE:
                    raise SystemExit(f"recall offline for {text!r}")
                run.unrelated.append((kind, len(reply.memories)))
            if progress:
                print(f"  {condition}: {conversation.name} asked", file=sys.stderr, flush=True)
    return run


def _recalled(texts: TextMap, recalled: list[str], run: Run) -> list[frozenset[str]]:
    out = []
    for text in recalled:
        ids = texts.ids(text)
        if ids is None:
            run.unmapped += 1
            ids = frozenset()
        out.append(ids)
    return out


def dated_writebacks() -> bool:
    """Whether this gateway's ``WritebackRequest`` carries ``occurred_at``."""
    from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb

    return "occurred_at" in pb.WritebackRequest.DESCRIPTOR.fields_by_name


def grpc_run(
    conversations: Sequence[Conversation],
    condition: str,
    ranking: str | None,
    progress: bool,
    public: Sequence[str] = (),
    server_url: str | None = None,
) -> Run:
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="arona-locomo-"))
        url = None if server_url is None else stack.enter_context(fresh_database(server_url))
        proc, target = start_stack(Path(tmp), ranking, url)
        db = Path(tmp) / "data" / "memory.db"
        wait = functools.partial(wait_for_vectors, db)
        if url is not None:
            wait = functools.partial(wait_for_pg_vectors, url)
        try:
            return asyncio.run(_grpc_run(conversations, target, condition, progress, public, wait))
        finally:
            proc.stop()


# -- in this process (settings trials) ---------------------------------------------------------


def direct_run(
    conversations: Sequence[Conversation],
    condition: str,
    ranking: str,
    workdir: Path,
    public: Sequence[str] = (),
) -> Run:
    """The same texts, scopes and times, written to and asked of a store in this process."""
    from arona_store.store import MemoryStore, NewNode

    run = Run(condition, grpc=False)
    asked_at = time.time()
    store = MemoryStore.open(workdir / f"locomo-{condition}-{ranking}.db", ranking=ranking)  # type: ignore[arg-type]
    vectors = _vectors(store, conversations) if ranking == "hybrid" else {}
    try:
        started = time.perf_counter()
        for conversation in conversations:
            node_type = scoped_node_type(scope_id(conversation.scope))
            times = turn_times(conversation, asked_at) if condition == "dated" else {}
            for turn in conversation.turns:
                when = times.get(turn.dia_id)
                properties = {} if when is None else {"occurred_at": when.isoformat()}
                store.add_many(
                    [
                        NewNode(
                            stored_text(turn),
                            node_type,
                            created_at=when,
                            properties=properties,
                            vector=vectors.get(stored_text(turn)),
                        )
                    ],
                    refresh=True,
                )
        run.write_s = time.perf_counter() - started
        for index, conversation in enumerate(conversations):
            node_type = scoped_node_type(scope_id(conversation.scope))
            texts = TextMap(conversation)
            for question in conversation.questions:
                began = time.perf_counter()
                hits = store.query(question.text, LIMIT, node_type=node_type)
                elapsed = (time.perf_counter() - began) * 1000
                run.answers.append(
                    Answer(index, question, _recalled(texts, [h.text for h in hits], run), elapsed)
                )
            for kind, text in unrelated_questions(conversations, index, public):
                hits = store.query(text, LIMIT, node_type=node_type)
                run.unrelated.append((kind, len(hits)))
    finally:
        store.close()
    return run


def buried_run(
    conversations: Sequence[Conversation], ranking: str, workdir: Path, nodes: int
) -> Run:
    """Each conversation written before ``nodes`` newer benchmark episodes, on its own, and
    its questions asked of the whole store (module docstring, ``--buried``)."""
    from arona_store.store import MemoryStore, NewNode
    from bench.recall_bench import preload

    run = Run(f"buried under {nodes:,} newer memories", grpc=False)
    template = workdir / "buried-template.db"
    preload(template, nodes, ranking)
    MemoryStore.open(template, ranking="lexical").close()  # merges its indexes once, for all
    with closing(sqlite3.connect(template)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    asked_at = time.time()
    db = workdir / "buried.db"
    for index, conversation in enumerate(conversations):
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        shutil.copyfile(template, db)
        store = MemoryStore.open(db, ranking=ranking)  # type: ignore[arg-type]
        try:
            vectors = _vectors(store, [conversation]) if ranking == "hybrid" else {}
            last = max(conversation.sessions.values())
            shift = datetime.fromtimestamp(asked_at, UTC) - timedelta(days=BURIED_DAYS) - last
            started = time.perf_counter()
            for turn in conversation.turns:
                text = stored_text(turn)
                when = conversation.sessions[turn.session] + shift
                store.add_many(
                    [NewNode(text, "episode", created_at=when, vector=vectors.get(text))],
                    refresh=True,
                )
            run.write_s += time.perf_counter() - started
            texts = TextMap(conversation)
            for question in conversation.questions:
                began = time.perf_counter()
                hits = store.query(question.text, LIMIT)
                elapsed = (time.perf_counter() - began) * 1000
                # A memory that is no dialog turn is one of the newer episodes: no evidence.
                recalled = [texts.ids(hit.text) or frozenset() for hit in hits]
                run.answers.append(Answer(index, question, recalled, elapsed))
        finally:
            store.close()
    return run


def _vectors(store: Any, conversations: Sequence[Conversation]) -> dict[str, bytes]:
    """Every turn's stored vector, embedded by ``store`` once and cached (by the model and
    what it embeds) for the next trial."""
    import hashlib

    from arona_store.embedding import MODEL_SHA256
    from arona_store.hybrid import VECTOR_TEXT
    from bench.recall_bench import _cache_dir

    texts = sorted({stored_text(t) for c in conversations for t in c.turns})
    key = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    path = _cache_dir() / f"locomo-{key}-{MODEL_SHA256[:16]}-{VECTOR_TEXT}.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        return {text: bytes.fromhex(blob) for text, blob in cached.items()}
    blobs = {}
    for i in range(0, len(texts), 64):
        chunk = texts[i : i + 64]
        blobs.update(zip(chunk, store.embed(chunk), strict=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({text: blob.hex() for text, blob in blobs.items()}))
    return blobs


# -- the report --------------------------------------------------------------------------------


def report(runs: Sequence[Run], ranking: str, via: str, public_from: str | None = None) -> str:
    lines = [
        "# Recall on LoCoMo",
        "",
        f"`python -m bench.recall_locomo` ({via}), ranking `{ranking}`,"
        f" {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. Evidence recall over the questions of"
        " categories 1-4 that name evidence; Recall limit 10; "
        + (
            f"each conversation alone in a store with the newer memories, its last session"
            f" {BURIED_DAYS} days before the questions, no scope."
            if any(run.condition.startswith("buried") for run in runs)
            else "one scope per conversation."
        ),
    ]
    if public_from is not None:
        lines += [
            "",
            f"Public unrelated questions: `{public_from}`, up to {PUBLIC_QUESTIONS} asked of"
            " each conversation, none of two.",
        ]
    for run in runs:
        lines += ["", f"## {run.condition}", ""]
        lines += table(run)
        lines += ["", latency_line(run, "through gRPC" if run.grpc else "in this process")]
        lines += ["", *unrelated_lines(run)]
        if run.unmapped:
            lines.append(f"{run.unmapped} recalled memories matched no dialog turn")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="LoCoMo's locomo10.json")
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument(
        "--ranking",
        choices=("hybrid", "lexical"),
        help="the store's ranking (default: as make run)",
    )
    parser.add_argument("--conditions", help="undated,dated (default: both)")
    parser.add_argument("--direct", action="store_true", help="a store in this process, no gRPC")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--store-database-url",
        metavar="URL",
        help="through gRPC, the store on PostgreSQL with pgvector: a server URL (a database"
        " is made on it for each run, dropped after)",
    )
    parser.add_argument(
        "--buried",
        type=int,
        metavar="N",
        help="each conversation written before N newer benchmark episodes, in this process",
    )
    parser.add_argument(
        "--unrelated",
        type=Path,
        help='public questions to ask as unrelated ones (JSON Lines, a "question" each:'
        " Natural Questions' NQ-open.dev.jsonl)",
    )
    args = parser.parse_args(argv)
    conditions = [c for c in (args.conditions or ",".join(CONDITIONS)).split(",") if c]
    if args.conditions is None and not args.direct and not dated_writebacks():
        print("WritebackRequest has no occurred_at here: undated only", file=sys.stderr)
        conditions = ["undated"]
    if not conditions or any(c not in CONDITIONS for c in conditions):
        parser.error(f"--conditions: a list of {', '.join(CONDITIONS)}")
    if args.buried is not None and args.buried < 1:
        parser.error("--buried: a number of episodes, at least 1")
    if not args.data.is_file():
        parser.error(
            f"{args.data} not found: get data/locomo10.json from the public LoCoMo repository"
            " (github.com/snap-research/locomo)"
        )
    conversations = load(args.data)
    public: list[str] = []
    if args.unrelated is not None:
        if not args.unrelated.is_file():
            parser.error(f"{args.unrelated} not found")
        try:
            public = load_public(args.unrelated)
        except ValueError as exc:
            parser.error(str(exc))
    from arona_store.ranking import ranking_from_env

    ranking = args.ranking or ranking_from_env(os.environ)
    if args.buried is not None:
        with tempfile.TemporaryDirectory(prefix="arona-locomo-") as tmp:
            runs = [buried_run(conversations, ranking, Path(tmp), args.buried)]
        via = "a store in this process, shared mode, each conversation before newer memories"
    elif args.direct:
        with tempfile.TemporaryDirectory(prefix="arona-locomo-") as tmp:
            runs = [direct_run(conversations, c, ranking, Path(tmp), public) for c in conditions]
        via = "a store in this process"
    else:
        runs = [
            grpc_run(
                conversations, c, args.ranking, not args.quiet, public, args.store_database_url
            )
            for c in conditions
        ]
        via = "through gRPC Writeback and Recall, `arona-gateway up`" + (
            ", the store on PostgreSQL (pgvector)" if args.store_database_url else ""
        )
    text = report(runs, ranking, via, None if args.unrelated is None else args.unrelated.name)
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
