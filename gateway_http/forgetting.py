"""``arona-gateway forget``: an operator's erasure of one scope, one principal, the turns of no
principal, or everything.

The memory goes through the running gRPC service's ``Forget`` (``ARONA_GRPC_TARGET``,
``ARONA_GRPC_TOKEN`` and ``ARONA_GRPC_TLS_CA`` as for the HTTP layer), which erases it from
Philia, the outbox, the dead letters, the episode index and the status events. The
conversations go from the database the HTTP layer keeps them in (``ARONA_DATABASE_URL``, else
``conversations.db`` under ``ARONA_DATA_DIR``), whose owner is the forgotten principal (the
turns of no principal: ``anonymous``), unless ``--keep-conversations``. Nothing is reported
as done that is not: a memory service that cannot finish stops the command before any
conversation is touched, with its reason (run it again).
"""

from __future__ import annotations

import sqlite3

from arona_common.database import DatabaseUnavailable, SchemaRefused, command_pool
from arona_grpc.config import Settings
from arona_grpc.scopes import principal_error, scope_error
from arona_grpc.service import DATABASE_UNAVAILABLE
from gateway_http.conversations import open_conversations
from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.grpc_channel import open_memory_channel
from gateway_http.memory_client import ForgetTarget, MemoryClient, command_client


class ForgetRefused(Exception):
    """The forget could not be done (one line, safe to print)."""


def _check(target: ForgetTarget) -> None:
    """The target as the command line gave it, or a refusal naming the option."""
    given = sum((bool(target.scope), bool(target.principal), target.anonymous, target.everything))
    if given != 1:
        raise ForgetRefused("give one of --scope, --principal, --anonymous and --all")
    if target.scope and (problem := scope_error(target.scope)) is not None:
        raise ForgetRefused(f"--{problem}")
    if target.principal and (problem := principal_error(target.principal)) is not None:
        raise ForgetRefused(f"--principal {problem}")


def _described(target: ForgetTarget) -> str:
    if target.everything:
        return "everyone"
    if target.anonymous:
        return "the turns of no principal"
    if target.principal:
        return f"principal {target.principal} (every scope it narrowed to included)"
    return f"scope {target.scope}"


async def forget(settings: Settings, target: ForgetTarget, *, keep_conversations: bool) -> str:
    """Forget ``target``'s memory (and conversations); what was done, in one line."""
    _check(target)
    channel = open_memory_channel(settings)
    client = command_client(settings, channel)
    where = settings.grpc_targets[0]
    try:
        deleted = await client.forget(target)
    except GatewayError as exc:
        raise ForgetRefused(await _failed(client, where, exc)) from None
    finally:
        await channel.close(None)
    done = f"forgot {deleted:,} episode(s) of {_described(target)}"
    owner = target.owner
    if keep_conversations or owner == "":
        return done + "; conversations kept"
    gone = await _forget_conversations(settings, owner)
    return f"{done} and {gone:,} conversation(s)"


async def _failed(client: MemoryClient, where: str, exc: GatewayError) -> str:
    """Why the memory service at ``where`` did not forget, naming it: the command may have
    dialled another address than the one the gateway serves on."""
    if exc.kind is ErrorKind.AUTH:
        return f"the memory service at {where} refused the credentials (ARONA_GRPC_TOKEN)"
    if exc.kind is ErrorKind.UNAVAILABLE and exc.code != DATABASE_UNAVAILABLE:
        # Unavailable is also Philia's failure half-way; Status, which never asks Philia,
        # tells an unreachable service from it.
        try:
            await client.status(1)
        except GatewayError:
            return (
                f"cannot reach the memory service at {where} (is `arona-gateway up` or "
                "`serve` running there? ARONA_GRPC_TARGET names it); nothing was forgotten"
            )
    return (
        f"the memory service at {where} did not finish: {exc.message} (nothing is reported "
        "done; run the same command again)"
    )


async def _forget_conversations(settings: Settings, owner: str | None) -> int:
    try:
        async with command_pool(settings.database_url) as pool:
            store = open_conversations(settings.data_dir, pool, settings.database_url)
            try:
                return await store.forget(owner)
            finally:
                await store.aclose()
    except (DatabaseUnavailable, SchemaRefused, sqlite3.Error) as exc:
        raise ForgetRefused(
            f"the memory is forgotten, the conversations are not: {exc} (run it again)"
        ) from None
