"""A usage summary as usage.summary answers it and as ``arona-gateway usage`` prints it (a table,
or CSV): the same rows, the same columns, in the same order."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gateway_http.usage.records import (
    GROUPS,
    MICRO,
    Budget,
    Spent,
    UsageQuery,
    UsageRow,
    UsageSummary,
    micros,
    month_start,
    parse_bound,
)

NUMBERS = (
    "turns",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "memory_tokens",
    "estimated_turns",
    "cost",
)


class BadQuery(ValueError):
    """A usage query that cannot be answered; the message says why (one line)."""


@dataclass(frozen=True)
class Period:
    start: datetime
    end: datetime


def period(start: str | None, end: str | None, now: datetime | None = None) -> Period:
    """``from`` and ``to`` of a query (unset: this calendar month so far, UTC).

    Without ``to`` the period ends now, or at ``from`` when ``from`` is still to come: an empty
    period, not a mistake. Only a ``to`` given, and not after ``from``, is refused."""
    now = now or datetime.now(UTC)
    try:
        first = parse_bound(start, end=False) if start is not None else month_start(now)
        last = parse_bound(end, end=True) if end is not None else max(now, first)
    except ValueError as exc:
        raise BadQuery(str(exc)) from None
    if last <= first and end is not None:
        if start is None:
            raise BadQuery(
                f"'to' must be after 'from' (unset: the start of this month, {first:%Y-%m-%d})"
            )
        raise BadQuery("'to' must be after 'from'")
    return Period(first, last)


def group_by(names: Sequence[str]) -> tuple[str, ...]:
    """The grouping asked for, checked: known names, each once."""
    for name in names:
        if name not in GROUPS:
            raise BadQuery(f"cannot group by {name!r}: use {', '.join(GROUPS)}")
    if len(set(names)) != len(names):
        raise BadQuery("group_by names a column twice")
    return tuple(names)


def query(when: Period, groups: tuple[str, ...], principal: str | None) -> UsageQuery:
    return UsageQuery(micros(when.start), micros(when.end), groups, principal)


def _numbers(row: UsageRow) -> dict[str, Any]:
    return {
        "turns": row.turns,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "total_tokens": row.total_tokens,
        "memory_tokens": row.memory_tokens,
        "estimated_turns": row.estimated_turns,
        "cost": _money(row.cost_micro),
    }


def rows(summary: UsageSummary, groups: tuple[str, ...]) -> list[dict[str, Any]]:
    """One JSON object per row: its group values, then the numbers (cost null: unpriced)."""
    return [{**dict(zip(groups, row.groups, strict=True)), **_numbers(row)} for row in summary.rows]


def totals(summary: UsageSummary) -> dict[str, Any]:
    """The numbers of every row added up (cost null when no row has one)."""
    each = summary.rows
    costs = [r.cost_micro for r in each if r.cost_micro is not None]
    return _numbers(
        UsageRow(
            (),
            sum(r.turns for r in each),
            sum(r.prompt_tokens for r in each),
            sum(r.completion_tokens for r in each),
            sum(r.memory_tokens for r in each),
            sum(r.estimated_turns for r in each),
            sum(costs) if costs else None,
        )
    )


def answer(
    when: Period, groups: tuple[str, ...], summary: UsageSummary, principal: str | None
) -> dict[str, Any]:
    """The result of usage.summary: whose usage it is (None: everyone's), the period, the rows."""
    return {
        "principal": principal,
        "from": rfc3339(when.start),
        "to": rfc3339(when.end),
        "group_by": list(groups),
        "rows": rows(summary, groups),
        "totals": totals(summary),
        "truncated": summary.truncated,
    }


def budget_view(budget: Budget, spent: Spent, month: str) -> dict[str, Any]:
    return {
        "month": month,
        "tokens": budget.tokens,
        "cost": _money(budget.cost_micro),
        "spent_tokens": spent.tokens,
        "spent_cost": _money(spent.cost_micro),
    }


def table(summary: UsageSummary, groups: tuple[str, ...]) -> str:
    """The rows as an aligned text table, a totals line under them (the one line, ungrouped)."""
    header = [*groups, *NUMBERS]
    lines = [[_cell(item.get(name)) for name in header] for item in rows(summary, groups)]
    total = [_cell(value) for value in totals(summary).values()]
    if not groups:
        lines = [total]
    else:
        lines.append(["total", *([""] * (len(groups) - 1)), *total])
    widths = [max([len(h), *(len(line[i]) for line in lines)]) for i, h in enumerate(header)]
    numeric = [False] * len(groups) + [True] * len(NUMBERS)

    def render(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if right else c.ljust(w)
            for c, w, right in zip(cells, widths, numeric, strict=True)
        ).rstrip()

    out = [render(header), *(render(line) for line in lines)]
    if summary.truncated:
        out.append(f"(only the first {len(summary.rows):,} rows)")
    return "\n".join(out)


def csv_text(summary: UsageSummary, groups: tuple[str, ...]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    header = [*groups, *NUMBERS]
    writer.writerow(header)
    for item in rows(summary, groups):
        writer.writerow(["" if item[n] is None else item[n] for n in header])
    return buffer.getvalue()


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _money(micro: int | None) -> float | None:
    return None if micro is None else round(micro / MICRO, 6)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
