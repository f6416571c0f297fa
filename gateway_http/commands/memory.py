"""The commands that reach memory: ``check-memory`` (does the configured Philia keep users apart),
``forget`` (through the gRPC service) and ``import`` (chat history into memory).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import (
    Mapping,
)
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arona_common.redact import redact_url
from arona_grpc.config import Settings

if TYPE_CHECKING:
    pass
from gateway_http.commands.runtime import StartupError, run_main

logger = logging.getLogger("arona_gateway")


async def _check_memory(env: Mapping[str, str]) -> int:
    """Probe the configured Philia (each store, when ``ARONA_MEMORY_URL`` names several) for
    user isolation; 0 when every one isolates, 1 otherwise."""
    settings = Settings.from_env(env)
    if not settings.memory_enabled:
        raise StartupError(
            "ARONA_MEMORY_URL and ARONA_MEMORY_TOKEN must be set: there is no Philia to check"
        )
    assert settings.memory_token is not None
    # Every store is asked: the processes behind one list may run different versions (a
    # rolling update), and one that ignores the filter would leak through the others.
    codes = [
        await _check_store(url, settings.memory_token, settings.memory_timeout_s)
        for url in settings.memory_urls
    ]
    return max(codes)


async def _check_store(url: str, token: str, timeout_s: float) -> int:
    """``check-memory`` on one store: 0 when it isolates users, 1 otherwise."""
    from arona_grpc.isolation import check_isolation
    from arona_grpc.philia import PhiliaClient, PhiliaError

    client = PhiliaClient(url, token, timeout_s)
    where = redact_url(url)
    try:
        report = await check_isolation(client)
    except PhiliaError as exc:
        print(f"check-memory: cannot tell: {client.redact(str(exc))}", flush=True)
        return 1
    finally:
        await client.aclose()
    if report.left_behind:
        print(
            f"check-memory: {len(report.left_behind)} probe(s) could not be deleted: "
            + ", ".join(report.left_behind),
            flush=True,
        )
    if report.isolated:
        print(f"check-memory: {where} isolates users: {report.summary}.", flush=True)
        return 0
    print(
        f"check-memory: {where} does NOT isolate users: {report.summary}. "
        "Do not run ARONA_MEMORY_SCOPE=user against it.",
        flush=True,
    )
    return 1


def add_forget_parser(sub: Any) -> None:
    forget = sub.add_parser(
        "forget",
        help="erase the memory (and conversations) of one scope, one principal, the turns of "
        "no principal, or everyone, through the gRPC service",
    )
    whose = forget.add_mutually_exclusive_group(required=True)
    whose.add_argument("--scope", help="one scope: PRINCIPAL or PRINCIPAL/USER")
    whose.add_argument(
        "--principal", help="every scope of one principal (a JWT sub, key:NAME), users included"
    )
    whose.add_argument(
        "--anonymous",
        action="store_true",
        help="the turns of no principal (shared mode, REST without a bearer)",
    )
    whose.add_argument("--all", action="store_true", help="everything the memory service stored")
    forget.add_argument(
        "--keep-conversations",
        action="store_true",
        help="leave the owner's conversations (default: they are deleted too)",
    )


def forget_command(settings: Settings, args: argparse.Namespace) -> None:
    from gateway_http import forgetting
    from gateway_http.memory_client import ForgetTarget

    target = ForgetTarget(
        scope=args.scope or "",
        principal=args.principal or "",
        anonymous=args.anonymous,
        everything=args.all,
    )
    printed: list[str] = []

    async def run() -> None:
        try:
            printed.append(
                await forgetting.forget(
                    settings, target, keep_conversations=args.keep_conversations
                )
            )
        except forgetting.ForgetRefused as exc:
            raise StartupError(str(exc)) from None

    run_main(run())
    print(printed[0], flush=True)


def add_import_parser(sub: Any) -> None:
    imports = sub.add_parser(
        "import",
        help="store chat history (OpenAI messages, one conversation or turn a line) as dated "
        "episodes through the gRPC service; resumable (exit 1 if any line was bad)",
    )
    imports.add_argument("file", type=Path, help="the JSON lines file (see docs/importing.md)")
    imports.add_argument(
        "--user",
        help="whose memory: the principal a chat would have (a JWT sub, key:NAME); a line's "
        "'user' narrows it as in a chat request; without it, shared memory or the line's user",
    )
    imports.add_argument(
        "--progress", type=Path, help="the progress file (default: FILE.progress beside FILE)"
    )
    imports.add_argument(
        "--check", action="store_true", help="only check the file: report bad lines, store nothing"
    )
    imports.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="turns sent at a time (default 32; 1: strictly one after another)",
    )


def check_memory_command(env: Mapping[str, str]) -> int:
    outcome: list[int] = []

    async def run() -> None:
        outcome.append(await _check_memory(env))

    run_main(run())
    return outcome[0]


def add_check_memory_parser(sub: Any) -> None:
    sub.add_parser(
        "check-memory",
        help="check that the configured Philia keeps users' memories apart (exit 0 if so)",
    )
