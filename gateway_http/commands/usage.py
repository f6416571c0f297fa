"""``usage`` and ``budget``: the usage table and the monthly budgets, read and set in the database
every replica shares.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import (
    Coroutine,
)
from typing import TYPE_CHECKING, Any

from arona_grpc.config import Settings

if TYPE_CHECKING:
    pass
from gateway_http.commands.runtime import StartupError, run_main

logger = logging.getLogger("arona_gateway")


def add_usage_parsers(sub: Any) -> None:
    usage = sub.add_parser(
        "usage",
        help="tokens used by principal, user, model, backend or day (what usage.summary answers)",
    )
    usage.add_argument(
        "--from", dest="start", help="YYYY-MM-DD or an RFC 3339 time (default: this month's start)"
    )
    usage.add_argument(
        "--to", dest="end", help="YYYY-MM-DD (that day included) or an RFC 3339 time (now)"
    )
    usage.add_argument(
        "--group-by",
        default="",
        help="comma-separated: principal, user, model, backend, day (default: one total)",
    )
    usage.add_argument("--principal", help="one principal's usage only (key:NAME, a JWT sub)")
    usage.add_argument("--csv", action="store_true", help="CSV instead of a table")
    budget = sub.add_parser(
        "budget", help="monthly token or cost budgets per principal: set, clear, list"
    )
    actions = budget.add_subparsers(dest="action", required=True)
    setting = actions.add_parser("set", help="set a principal's budget (or the default one)")
    clearing = actions.add_parser("clear", help="remove a principal's budget (or the default)")
    for action in (setting, clearing):
        action.add_argument("principal", nargs="?", help="key:NAME or a JWT sub")
        action.add_argument(
            "--default", action="store_true", help="the budget of every principal without one"
        )
    setting.add_argument("--tokens", type=int, help="prompt + completion tokens a month")
    setting.add_argument(
        "--cost", type=float, help="cost a month, in the prices' currency (the backends file)"
    )
    actions.add_parser("list", help="every budget and this month's spending")


def usage_commands(settings: Settings, args: argparse.Namespace) -> None:
    from gateway_http.usage import commands

    work: Coroutine[Any, Any, str]
    if args.command == "usage":
        work = commands.usage_command(
            settings, args.start, args.end, args.group_by, args.principal, as_csv=args.csv
        )
    elif args.action == "list":
        work = commands.budget_list(settings)
    else:
        if (args.principal is None) == (not args.default):
            raise StartupError("name a PRINCIPAL or give --default (one of the two)")
        if args.action == "set":
            change = commands.BudgetChange(args.principal, args.tokens, args.cost)
            work = commands.budget_set(settings, change)
        else:
            work = commands.budget_clear(settings, args.principal)
    printed: list[str] = []

    async def run() -> None:
        try:
            printed.append(await work)
        except commands.CommandError as exc:
            raise StartupError(str(exc)) from None

    run_main(run())
    print(printed[0], flush=True)
