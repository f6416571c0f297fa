"""What one metered turn leaves behind, what a summary of many is, and a monthly budget.

A :class:`UsageRecord` is one chat turn that went upstream: whose it was (the principal, an
API key's ``key:<name>`` or a JWT ``sub``, and the OpenAI ``user`` that narrowed it), which
model and backend answered, its tokens (as the upstream reported them, or counted by
:mod:`gateway_http.usage.tokens` and marked ``estimated``), the memory section's share of the
prompt, its latency and outcome. ``turn_id`` is unique per turn: storing a record twice (a
batch retried after a lost commit) keeps one.

Days and months are UTC: a budget is per calendar month in UTC, ``day`` groups by UTC date.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

# What usage.summary and `arona-gateway usage` may group by, and the column of each.
GROUPS = ("principal", "user", "model", "backend", "day")
GROUP_COLUMNS = {
    "principal": "principal",
    "user": "user_name",
    "model": "model",
    "backend": "backend",
    "day": "day",
}
# The principal under which the budget of every principal without its own is kept (never a
# principal: a JWT sub and an API key name are never empty).
DEFAULT_BUDGET = ""
# A summary returns at most this many rows (and says it was cut).
MAX_SUMMARY_ROWS = 10_000
MICRO = 1_000_000


@dataclass(frozen=True, slots=True)
class UsageRecord:
    turn_id: str
    # Microseconds since the epoch (UTC) when the turn ended.
    at_us: int
    principal: str
    # The OpenAI `user` of the request ("" without one).
    user: str
    model: str
    backend: str
    # rest, rest_stream, rpc, rpc_ws.
    surface: str
    # ok, upstream_error, cancelled.
    outcome: str
    prompt_tokens: int
    completion_tokens: int
    # The memory section's share of the prompt (counted by the gateway's tokenizer).
    memory_tokens: int
    # The upstream reported no usage: prompt and completion were counted by the gateway.
    estimated: bool
    latency_ms: float
    # Millionths of the prices' currency; None when the model has no price.
    cost_micro: int | None = None

    @property
    def day(self) -> str:
        return utc_datetime(self.at_us).strftime("%Y-%m-%d")

    @property
    def month(self) -> str:
        return self.day[:7]

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class UsageQuery:
    """Records ended in ``[start_us, end_us)``, of one principal (None: everyone's), summed
    per distinct value of the ``group_by`` columns (none: one row)."""

    start_us: int
    end_us: int
    group_by: tuple[str, ...] = ()
    principal: str | None = None


@dataclass(frozen=True)
class UsageRow:
    # The group values, in the query's group_by order.
    groups: tuple[str, ...]
    turns: int
    prompt_tokens: int
    completion_tokens: int
    memory_tokens: int
    estimated_turns: int
    cost_micro: int | None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class UsageSummary:
    rows: tuple[UsageRow, ...]
    # More rows matched than MAX_SUMMARY_ROWS.
    truncated: bool = False


@dataclass(frozen=True)
class Budget:
    """A principal's monthly allowance: tokens (prompt + completion), cost, or both."""

    tokens: int | None = None
    cost_micro: int | None = None


@dataclass(frozen=True)
class Spent:
    tokens: int = 0
    cost_micro: int = 0

    def __add__(self, other: Spent) -> Spent:
        return Spent(self.tokens + other.tokens, self.cost_micro + other.cost_micro)

    def __sub__(self, other: Spent) -> Spent:
        return Spent(self.tokens - other.tokens, self.cost_micro - other.cost_micro)

    def over(self, budget: Budget) -> bool:
        """Whether this much spending has used ``budget`` up."""
        return (budget.tokens is not None and self.tokens >= budget.tokens) or (
            budget.cost_micro is not None and self.cost_micro >= budget.cost_micro
        )


@dataclass(frozen=True)
class Price:
    """A model's price per million tokens, in the prices' currency (the backends file)."""

    input_per_million: float
    output_per_million: float

    def cost_micro(self, prompt_tokens: int, completion_tokens: int) -> int:
        """In millionths of the currency: per million tokens, a price is micros per token."""
        return round(
            prompt_tokens * self.input_per_million + completion_tokens * self.output_per_million
        )


def spent_of(record: UsageRecord) -> Spent:
    return Spent(record.tokens, record.cost_micro or 0)


def utc_datetime(at_us: int) -> datetime:
    return datetime.fromtimestamp(at_us / MICRO, UTC)


def micros(moment: datetime) -> int:
    return int(moment.timestamp() * MICRO)


def micros_now() -> int:
    return time.time_ns() // 1000


def month_of(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m")


def month_start(moment: datetime) -> datetime:
    """The first instant of ``moment``'s calendar month, UTC."""
    moment = moment.astimezone(UTC)
    return datetime(moment.year, moment.month, 1, tzinfo=UTC)


def next_month(moment: datetime) -> datetime:
    start = month_start(moment)
    return (start + timedelta(days=32)).replace(day=1)


def parse_bound(text: str, *, end: bool) -> datetime:
    """A summary bound: ``YYYY-MM-DD`` (a UTC day: its start for ``from``, the start of the
    next day for ``to``, so ``to`` takes in its whole day) or an RFC 3339 time with an offset.
    ``ValueError`` says what is wrong."""
    text = text.strip()
    if len(text) == 10:
        try:
            day = date.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a date (YYYY-MM-DD)") from None
        moment = datetime(day.year, day.month, day.day, tzinfo=UTC)
        return moment + timedelta(days=1) if end else moment
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text!r} is not a date (YYYY-MM-DD) or an RFC 3339 time (2026-12-01T00:00:00Z)"
        ) from None
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no UTC offset (add Z or +HH:MM)")
    return moment.astimezone(UTC)


def summary_sql(query: UsageQuery, param: str) -> tuple[str, list[object]]:
    """The summary's SQL for both backends (``param``: ``?`` or ``$``, numbered for
    PostgreSQL) and its arguments."""
    args: list[object] = [query.start_us, query.end_us]

    def placeholder(n: int) -> str:
        return f"${n}" if param == "$" else "?"

    where = f"at_us >= {placeholder(1)} AND at_us < {placeholder(2)}"
    if query.principal is not None:
        args.append(query.principal)
        where += f" AND principal = {placeholder(3)}"
    columns = [GROUP_COLUMNS[g] for g in query.group_by]
    select = ", ".join(
        [
            *columns,
            "count(*)",
            "CAST(sum(prompt_tokens) AS BIGINT)",
            "CAST(sum(completion_tokens) AS BIGINT)",
            "CAST(sum(memory_tokens) AS BIGINT)",
            "CAST(sum(CASE WHEN estimated THEN 1 ELSE 0 END) AS BIGINT)",
            "CAST(sum(cost_micro) AS BIGINT)",
        ]
    )
    sql = f"SELECT {select} FROM usage_records WHERE {where}"
    if columns:
        listed = ", ".join(columns)
        sql += f" GROUP BY {listed} ORDER BY {listed}"
    sql += f" LIMIT {MAX_SUMMARY_ROWS + 1}"
    return sql, args


def summary_of(rows: Sequence[Sequence[Any]], groups: int) -> UsageSummary:
    """A :class:`UsageSummary` of the summary query's rows (an empty period: no row)."""
    out = []
    for row in rows[:MAX_SUMMARY_ROWS]:
        turns = int(row[groups])
        if turns == 0:
            continue
        prompt, completion, memory, estimated = (int(v or 0) for v in row[groups + 1 : groups + 5])
        cost = row[groups + 5]
        out.append(
            UsageRow(
                tuple(str(v) for v in row[:groups]),
                turns,
                prompt,
                completion,
                memory,
                estimated,
                int(cost) if cost is not None else None,
            )
        )
    return UsageSummary(tuple(out), len(rows) > MAX_SUMMARY_ROWS)
