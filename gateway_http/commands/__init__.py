"""The ``arona-gateway`` command line, one module per group of commands: ``up``, ``serve`` and
``store`` (:mod:`~gateway_http.commands.serving`), ``token`` (:mod:`~gateway_http.commands.tokens`),
``migrate`` and ``store-copy`` (:mod:`~gateway_http.commands.database`), ``check-memory``,
``import`` and ``forget`` (:mod:`~gateway_http.commands.memory`), ``usage`` and ``budget``
(:mod:`~gateway_http.commands.usage`), ``mcp`` (:mod:`~gateway_http.commands.mcp`), on what they
share (:mod:`~gateway_http.commands.runtime`).

:func:`main` is the only place that configures logging and reads the environment (once, into
:class:`~arona_grpc.config.Settings`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from arona_common import tracing
from arona_grpc.config import ConfigError, Settings
from arona_store.ranking import RankingError
from gateway_http.commands import database, mcp, memory, serving, tokens, usage
from gateway_http.commands.runtime import (
    StartupError,
    check_data_dir,
    configure_logging,
    load_backends_file,
    prefer_grpc_iomgr,
    run_main,
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command, each group adding its own sub-parsers."""
    parser = argparse.ArgumentParser(
        prog="arona-gateway",
        description="OpenAI-compatible chat gateway with long-term memory (Philia).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serving.add_serving_parsers(sub)
    tokens.add_token_parser(sub)
    database.add_database_parsers(sub)
    memory.add_check_memory_parser(sub)
    memory.add_import_parser(sub)
    usage.add_usage_parsers(sub)
    memory.add_forget_parser(sub)
    mcp.mcp_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == mcp.COMMAND:
        # The stdio bridge: its settings are its own (gateway_http.mcp.bridge).
        return mcp.mcp_command(os.environ)
    if getattr(args, "supervised", False):
        # Before anything else: a group-wide SIGTERM arriving while it starts is ignored too.
        from gateway_http.workers import ignore_stop_signals

        ignore_stop_signals()
    env = os.environ
    prefer_grpc_iomgr(env)
    try:
        settings = Settings.from_env(env)
        only = getattr(args, "only", None)  # `serve --only`; `up` runs every part
        # Read and checked before anything starts, by every process that serves HTTP.
        backends = (
            load_backends_file(settings, env)
            if args.command == "up" or (args.command == "serve" and only != "grpc")
            else None
        )
        configure_logging(settings, backends)
        if args.command in ("up", "serve", "store"):
            check_data_dir(settings.data_dir)
            serving.warn_short_token(settings, args)
        if args.command == "up" or (args.command == "serve" and only != "http"):
            # Before any part starts: a gRPC listener it would refuse (beyond loopback
            # without a token, unusable TLS files) is one line, nothing started and stopped.
            from arona_grpc.security import check_listener

            check_listener(settings)
            local_tls = settings.grpc_tls_cert is not None and settings.grpc_target is None
            if only is None and local_tls and settings.grpc_tls_ca is None:
                raise StartupError(
                    "ARONA_GRPC_TLS_CA must be set with ARONA_GRPC_TLS_CERT: the HTTP gateway "
                    "calls its own gRPC listener over TLS and checks its certificate"
                )
        if args.command == "token":
            from arona_grpc.scopes import subject_error

            if args.ttl <= 0:
                raise StartupError("--ttl must be positive")
            problem = subject_error(args.sub)
            if problem is not None:
                raise StartupError(problem.replace("the token's 'sub'", "--sub"))
            print(tokens.mint(env, args.sub, args.ttl, args.admin))
        elif args.command == "check-memory":
            return memory.check_memory_command(env)
        elif args.command == "import":
            from gateway_http.importing import import_command

            return import_command(
                settings,
                args.file,
                user=args.user,
                progress=args.progress,
                check=args.check,
                concurrency=args.concurrency,
            )
        elif args.command == "migrate":
            run_main(database.migrate_command(env))
        elif args.command == "store-copy":
            from arona_store.pg.copy import copy_command

            return copy_command(args.source, args.dest)
        elif args.command in ("usage", "budget"):
            usage.usage_commands(settings, args)
        elif args.command == "forget":
            memory.forget_command(settings, args)
        elif args.command == "up":
            with tracing.started(env, tracing.GATEWAY_SERVICE):
                run_main(serving.up(env, backends))
        elif args.command == "serve":
            if args.workers < 1:
                raise StartupError("--workers must be at least 1")
            if args.workers > 1:
                if args.only == "grpc":
                    raise StartupError("--workers is for the HTTP layer; not with --only grpc")
                # The supervisor serves nothing: each worker traces itself.
                return serving.serve_workers(env, args.workers, grpc_part=args.only != "http")
            service = tracing.MEMORY_SERVICE if args.only == "grpc" else tracing.GATEWAY_SERVICE
            with tracing.started(env, service):
                run_main(
                    serving.serve(
                        env, args.only, args.listen_fd, args.worker, args.supervised, backends
                    )
                )
        else:
            with tracing.started(env, tracing.STORE_SERVICE):
                run_main(serving.store(env, args.host, args.port))
    except (ConfigError, StartupError, RankingError) as exc:
        # One line per mistake (a backends file may have several).
        for line in str(exc).splitlines():
            print(f"arona-gateway: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
