"""The usage meter: one record per answered turn, written off the chat path in batches.

The turn pipeline hands each turn whose upstream answer began to :meth:`UsageMeter.record`:
an append to a list (and, when budgets are set, an addition to its principal's spending).
Everything else happens on the meter's own task: counting what the upstream did not report and
the memory section's share of the prompt (on a thread of its own: tiktoken), pricing, the
Prometheus counters, and one store transaction per batch, every :data:`FLUSH_S` or as soon as
:data:`BATCH` turns wait.

While the store is unreachable the records wait, at most :data:`MAX_WAITING` of them (the
oldest beyond that are given up, counted in ``arona_usage_dropped_total``), and go again with
the next batch; a record is stored once however often it is sent (its ``turn_id``). A gateway
that stops writes what waits; one killed outright loses the turns of its last batch interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from arona_common.database import DatabaseUnavailable
from gateway_http.metrics import GatewayMetrics
from gateway_http.usage.budgets import Budgets
from gateway_http.usage.records import Price, Spent, UsageRecord, micros_now, spent_of
from gateway_http.usage.store import UsageStore
from gateway_http.usage.tokens import TokenCounter

logger = logging.getLogger(__name__)

FLUSH_S = 0.5
BATCH = 512
MAX_WAITING = 100_000
# How long a stopping gateway gives the last batches.
CLOSE_GRACE_S = 5.0

# The price of a model on a backend (backend, model) -> Price, or None when it has none.
PriceOf = Callable[[str, str], Price | None]


@dataclass(slots=True)
class EndedTurn:
    """A turn whose upstream answer began, as the pipeline hands it over."""

    turn_id: str
    principal: str
    user: str
    model: str
    backend: str
    surface: str
    outcome: str
    latency_ms: float
    # The upstream's usage object (None when it sent none).
    usage: Any
    # The messages sent upstream and the reply: counted only when ``usage`` says nothing.
    prompt: list[Any]
    reply: str
    reply_message: dict[str, Any] | None
    # The memory section injected into the prompt ("" for none).
    section: str
    at_us: int = field(default_factory=micros_now)


def reported(usage: Any) -> tuple[int, int] | None:
    """(prompt, completion) tokens of an upstream's usage object, if it has both."""
    if not isinstance(usage, dict):
        return None
    prompt = _count_of(usage.get("prompt_tokens"))
    completion = _count_of(usage.get("completion_tokens"))
    if prompt is None or completion is None:
        return None
    return prompt, completion


def _count_of(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


class UsageMeter:
    def __init__(
        self,
        store: UsageStore,
        budgets: Budgets,
        metrics: GatewayMetrics,
        *,
        price_of: PriceOf | None = None,
        counter: TokenCounter | None = None,
    ) -> None:
        self._store = store
        self._budgets = budgets
        self._metrics = metrics
        self._price_of = price_of
        self._counter = counter or TokenCounter()
        self._new: list[EndedTurn] = []
        # Counted, not stored yet (the store was unreachable), oldest first.
        self._waiting: list[UsageRecord] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._passes_started = 0
        self._passes_done = 0
        self._passed = asyncio.Condition()
        self._failing = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arona-usage-count")
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load the tokenizer (on the meter's thread, before any turn: its load holds the
        interpreter for about a second, once per process), then start writing."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._counter.load)
        self._task = asyncio.create_task(self._run(), name="usage-meter")

    def record(self, turn: EndedTurn) -> None:
        """Take an ended turn (on the chat path: no I/O, no counting)."""
        self._new.append(turn)
        if self._budgets.active:
            tokens = reported(turn.usage)
            if tokens is not None:
                cost = self._cost(turn.backend, turn.model, *tokens)
                self._budgets.spending(turn.principal, Spent(sum(tokens), cost or 0))
        if len(self._new) >= BATCH:
            self._wake.set()

    async def flush(self, timeout_s: float = CLOSE_GRACE_S) -> None:
        """Return once every turn recorded before the call was stored (or its batch failed),
        or after ``timeout_s``: usage.summary reads the caller's own last turns."""
        target = self._passes_started + 1
        self._wake.set()
        async with self._passed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._passed.wait_for(lambda: self._passes_done >= target), timeout_s
                )

    async def aclose(self) -> None:
        """Store what waits (within :data:`CLOSE_GRACE_S`), then stop."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, CLOSE_GRACE_S)
            except TimeoutError:
                logger.warning("usage records of %d turn(s) were not stored", self.unsaved)
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def unsaved(self) -> int:
        return len(self._new) + len(self._waiting)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), FLUSH_S)
            self._wake.clear()
            self._passes_started += 1
            try:
                await self._pass()
            except Exception:
                logger.exception("usage metering failed")
            async with self._passed:
                self._passes_done += 1
                self._passed.notify_all()
            if self._closing:
                return

    async def _pass(self) -> None:
        """Count and store everything that waits, a batch at a time."""
        loop = asyncio.get_running_loop()
        while self._new or self._waiting:
            if self._new:
                turns, self._new = self._new[:BATCH], self._new[BATCH:]
                counted, estimated = await loop.run_in_executor(self._executor, self._count, turns)
                for principal, spent in estimated.items():
                    self._budgets.spending(principal, spent)
                self._waiting.extend(counted)
            batch = self._waiting[:BATCH]
            if not await self._store_batch(batch):
                self._bound_waiting()
                return
            del self._waiting[: len(batch)]

    async def _store_batch(self, batch: list[UsageRecord]) -> bool:
        spent: dict[str, Spent] = {}
        for record in batch:
            spent[record.principal] = spent.get(record.principal, Spent()) + spent_of(record)
        try:
            async with self._budgets.lock:
                await self._store.add(batch)
                self._budgets.stored(spent)
        except (DatabaseUnavailable, sqlite3.Error, OSError) as exc:
            if not self._failing:
                # A database outage is said once, by arona_common.database.
                logger.log(
                    logging.DEBUG if isinstance(exc, DatabaseUnavailable) else logging.WARNING,
                    "usage records could not be stored (they wait, %d now): %s",
                    len(self._waiting),
                    exc,
                )
            self._failing = True
            return False
        if self._failing:
            logger.info("usage records are stored again")
            self._failing = False
        return True

    def _bound_waiting(self) -> None:
        over = len(self._waiting) - MAX_WAITING
        if over > 0:
            del self._waiting[:over]
            self._metrics.usage_dropped(over)
            logger.warning("%d usage record(s) given up: the usage store is unreachable", over)

    def _count(self, turns: list[EndedTurn]) -> tuple[list[UsageRecord], dict[str, Spent]]:
        """The records of ``turns`` (on the meter's thread), and what the estimated ones spent
        by principal (the reported ones were told to the budgets as they ended)."""
        counter = self._counter
        records = []
        estimated_spent: dict[str, Spent] = {}
        for turn in turns:
            tokens = reported(turn.usage)
            estimated = tokens is None
            if tokens is None:
                tokens = (
                    counter.prompt(turn.prompt),
                    counter.reply(turn.reply, turn.reply_message),
                )
            memory = counter.section(turn.section)
            cost = self._cost(turn.backend, turn.model, *tokens)
            record = UsageRecord(
                turn_id=turn.turn_id,
                at_us=turn.at_us,
                principal=turn.principal,
                user=turn.user,
                model=turn.model,
                backend=turn.backend,
                surface=turn.surface,
                outcome=turn.outcome,
                prompt_tokens=tokens[0],
                completion_tokens=tokens[1],
                memory_tokens=memory,
                estimated=estimated,
                latency_ms=turn.latency_ms,
                cost_micro=cost,
            )
            records.append(record)
            if estimated:
                estimated_spent[turn.principal] = estimated_spent.get(
                    turn.principal, Spent()
                ) + spent_of(record)
            self._metrics.tokens(turn.backend, tokens[0], tokens[1], memory)
        return records, estimated_spent

    def _cost(self, backend: str, model: str, prompt: int, completion: int) -> int | None:
        if self._price_of is None:
            return None
        price = self._price_of(backend, model)
        return price.cost_micro(prompt, completion) if price is not None else None
