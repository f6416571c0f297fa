"""JSON-RPC methods: ``chat.send``, ``memory.status``, ``memory.recall``, ``memory.delete``,
``memory.list``, ``memory.forget``, ``conversations.*`` and ``usage.summary``, registered on the
transport's :class:`Dispatcher`.

Every method runs as the JWT's ``sub``; failures become JSON-RPC errors through
the one error table (:mod:`gateway_http.errors`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

from opentelemetry.trace import Span
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from arona_common import tracing
from arona_grpc.logs import REQUEST_ID
from gateway_http.auth import Principal, memory_scope
from gateway_http.chat_request import ChatOptions, NonEmpty, User, validate_messages
from gateway_http.conversations import PAGE_DEFAULT_MESSAGES, PAGE_MAX_MESSAGES
from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.jsonrpc import INVALID_PARAMS, Dispatcher, RpcContext, RpcError
from gateway_http.memory_client import (
    DISABLED,
    NOT_INDEXED,
    OTHER_SCOPE,
    ForgetTarget,
    storage_fault_view,
)
from gateway_http.routes.rest import turn_outcome, upstream_failure
from gateway_http.state import Gateway
from gateway_http.turns import (
    RECALL_LIMIT,
    PreparedTurn,
    TurnRequest,
    delta_text,
    first_choice,
)
from gateway_http.upstream.backend import UpstreamError
from gateway_http.usage import report
from gateway_http.usage.records import month_of
from gateway_http.views import conversation_errors, conversation_view, conversation_with_messages

P = TypeVar("P", bound=BaseModel)

# Why memory.delete deleted nothing in user mode, as a caller who is not an admin hears it:
# the id is not one of theirs (another's, or nobody's).
NOT_YOURS = "not_yours"
CHAT_SEND = "chat.send"
# What a shared-mode forget of a scope or principal adds: the turns of REST callers without a
# bearer (the banner's chat line) are no caller's, and erased only by name.
SHARED_FORGET_HINT = (
    "shared mode: turns sent to REST without a bearer belong to no principal, and a forget "
    'of a scope or principal does not reach them: memory.forget {"anonymous": true} erases '
    'them, memory.list {"anonymous": true} lists them'
)
TRACER = tracing.Tracer("gateway_http")


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatSendParams(ChatOptions):
    """chat.send: a model, its messages, and the optional fields REST checks alike."""

    model_config = ConfigDict(extra="forbid")
    model: NonEmpty
    messages: list[Any]


class StatusParams(_Params):
    limit: Annotated[StrictInt, Field(ge=1, le=100)] = 50


class _ScopeParams(_Params):
    """Whose memory a memory method acts on: the caller's own scope, ``user`` to narrow it
    as a turn's OpenAI ``user`` field did (``<principal>/<user>``), or ``scope`` naming one
    (another's is an admin's right in user mode)."""

    scope: NonEmpty | None = None
    user: User | None = None

    @model_validator(mode="after")
    def _one_of_scope_and_user(self) -> _ScopeParams:
        if self.scope is not None and self.user is not None:
            raise ValueError("give 'scope' or 'user', not both")
        return self


class RecallParams(_ScopeParams):
    query: NonEmpty
    limit: Annotated[StrictInt, Field(ge=1, le=100)] = RECALL_LIMIT


class DeleteParams(_ScopeParams):
    node_id: NonEmpty


class ListParams(_ScopeParams):
    limit: Annotated[StrictInt, Field(ge=1, le=100)] = 50
    before: NonEmpty | None = None
    # The episodes of no principal (shared mode's open REST turns) instead of a scope's.
    anonymous: StrictBool = False
    # Only the episodes whose preview holds this text (any case).
    contains: NonEmpty | None = None

    @model_validator(mode="after")
    def _anonymous_alone(self) -> ListParams:
        if self.anonymous and (self.scope is not None or self.user is not None):
            raise ValueError("give 'anonymous' alone, without 'scope' or 'user'")
        return self


class ForgetParams(_ScopeParams):
    """Whose memory to forget: the caller's own scope (or one named by ``scope`` or narrowed
    by ``user``), every scope of one ``principal``, the episodes of no principal
    (``anonymous``), or ``everything``; the owner's conversations go too unless
    ``keep_conversations``."""

    principal: NonEmpty | None = None
    anonymous: StrictBool = False
    everything: StrictBool = False
    keep_conversations: StrictBool = False

    @model_validator(mode="after")
    def _one_target(self) -> ForgetParams:
        given = [
            self.scope is not None,
            self.user is not None,
            self.principal is not None,
            self.anonymous,
            self.everything,
        ]
        if sum(given) > 1:
            raise ValueError(
                "give at most one of 'scope', 'user', 'principal', 'anonymous' and 'everything'"
            )
        return self


class CreateConversationParams(_Params):
    title: StrictStr | None = None


class ConversationParams(_Params):
    conversation_id: NonEmpty


class GetConversationParams(ConversationParams):
    limit: Annotated[StrictInt, Field(ge=1, le=PAGE_MAX_MESSAGES)] = PAGE_DEFAULT_MESSAGES
    before: NonEmpty | None = None


class NoParams(_Params):
    pass


class UsageSummaryParams(_Params):
    start: NonEmpty | None = Field(None, alias="from")
    to: NonEmpty | None = None
    group_by: list[StrictStr] = []
    # Whose usage: the caller's own unless an admin names another (or nobody: everyone's).
    principal: NonEmpty | None = None

    @model_validator(mode="after")
    def _valid_query(self) -> UsageSummaryParams:
        try:
            report.period(self.start, self.to)
            report.group_by(self.group_by)
        except report.BadQuery as exc:
            raise ValueError(str(exc)) from None
        return self


# Each method's params: what register_methods registers, and what /openapi.json publishes
# (gateway_http.openapi).
METHOD_PARAMS: dict[str, type[BaseModel]] = {
    "chat.send": ChatSendParams,
    "memory.status": StatusParams,
    "memory.recall": RecallParams,
    "memory.delete": DeleteParams,
    "memory.list": ListParams,
    "memory.forget": ForgetParams,
    "conversations.create": CreateConversationParams,
    "conversations.get": GetConversationParams,
    "conversations.list": NoParams,
    "conversations.delete": ConversationParams,
    "usage.summary": UsageSummaryParams,
}


def _translated(
    handler: Callable[[P, RpcContext], Awaitable[Any]],
) -> Callable[[P, RpcContext], Awaitable[Any]]:
    """Turn domain failures into JSON-RPC errors, through the one table."""

    async def run(params: P, ctx: RpcContext) -> Any:
        try:
            with conversation_errors():
                return await handler(params, ctx)
        except GatewayError as exc:
            code, message, data = exc.jsonrpc_error()
            raise RpcError(code, message, data) from None
        except UpstreamError as exc:
            code, message, data = upstream_failure(exc).jsonrpc_error()
            raise RpcError(code, message, data) from None

    return run


def _chat_send_span() -> AbstractContextManager[Span]:
    """A ``chat.send`` turn's server span: over HTTP the child of the request's traceparent
    (the transport made it current), over a WebSocket a trace of its own per call."""
    if not tracing.active():
        return tracing.NO_SPAN
    return TRACER.span(
        CHAT_SEND,
        kind=tracing.SERVER,
        attributes={
            "rpc.system": "jsonrpc",
            "rpc.method": CHAT_SEND,
            "arona.request_id": REQUEST_ID.get() or "",
        },
    )


def _not_allowed(what: str) -> GatewayError:
    return GatewayError(
        ErrorKind.NOT_ALLOWED, f"Not allowed: {what} needs an admin token", "admin_required"
    )


def register_methods(dispatcher: Dispatcher, gw: Gateway) -> None:
    user_scoped = gw.settings.user_scoped

    def scope_for(ctx: RpcContext, params: _ScopeParams) -> str:
        """The scope a memory method acts on: the caller's own (or one they narrowed, by
        ``user`` or by naming it), unless an admin (or anyone, in shared mode) names another."""
        own = ctx.user
        if params.user is not None:
            return memory_scope(Principal(own), params.user) or own
        requested = params.scope
        if requested is None:
            return own
        if requested == own or requested.startswith(own + "/"):
            return requested
        if user_scoped and not ctx.admin:
            raise _not_allowed("another user's memory")
        return requested

    async def chat_send(params: ChatSendParams, ctx: RpcContext) -> dict[str, Any]:
        with _chat_send_span():
            return await _chat_send(params, ctx)

    async def _chat_send(params: ChatSendParams, ctx: RpcContext) -> dict[str, Any]:
        started = time.perf_counter()
        surface = "rpc" if ctx.notify is None else "rpc_ws"
        pipeline = gw.pipeline
        try:
            messages = validate_messages(params.messages)
        except GatewayError as exc:
            pipeline.metrics.turn(surface, DISABLED, "client_error")
            raise RpcError(INVALID_PARAMS, exc.message) from None
        body: dict[str, Any] = {"model": params.model, "messages": messages}
        if params.temperature is not None:
            body["temperature"] = params.temperature
        if params.max_tokens is not None:
            body["max_tokens"] = params.max_tokens
        if params.user is not None:
            body["user"] = params.user
        scope = memory_scope(Principal(ctx.user), params.user)
        try:
            turn = await pipeline.prepare(
                TurnRequest(ctx.user, body, params.memory, params.conversation_id, scope, started)
            )
        except GatewayError as exc:
            pipeline.metrics.turn(surface, DISABLED, turn_outcome(exc))
            raise
        try:
            result = await _answer(turn, ctx)
        except UpstreamError:
            pipeline.finished(turn, surface, "upstream_error")
            raise
        except asyncio.CancelledError:
            pipeline.finished(turn, surface, "cancelled")
            raise
        pipeline.finished(turn, surface, "ok")
        return result

    async def _answer(turn: PreparedTurn, ctx: RpcContext) -> dict[str, Any]:
        stream_id = f"stream-{uuid.uuid4().hex}"
        if ctx.notify is None:
            reply = await gw.pipeline.complete(turn)
            content, finish_reason, usage = reply.content, reply.finish_reason, reply.usage
        else:
            # Over WebSocket: push tokens as they arrive, then answer. The RPC
            # path writes back whether or not a conversation is attached.
            parts: list[str] = []
            finish_reason = None
            async for chunk in gw.pipeline.stream(turn, writeback=True):
                token = delta_text(chunk)
                finish_reason = first_choice(chunk).get("finish_reason") or finish_reason
                if token:
                    parts.append(token)
                    await ctx.notify(
                        "chat.stream",
                        {"stream_id": stream_id, "token": token, "is_complete": False},
                    )
            await ctx.notify(
                "chat.stream", {"stream_id": stream_id, "token": "", "is_complete": True}
            )
            content = "".join(parts)
            # As the upstream reported it (asked for when metering is on).
            usage = turn.usage
        return {
            "stream_id": stream_id,
            "memory": turn.memory_state,
            "memory_count": turn.memory_count,
            "backend": turn.backend,
            "content": content,
            "finish_reason": finish_reason,
            "usage": usage,
        }

    async def memory_status(params: StatusParams, ctx: RpcContext) -> dict[str, Any]:
        if user_scoped and not ctx.admin:
            # Every user's recent questions are in it.
            raise _not_allowed("memory.status")
        status = await gw.memory.status(params.limit)
        gw.pipeline.storage.recheck()
        # This HTTP process's own files (its journal) after the memory service's.
        status["storage_faults"] = [
            *status.get("storage_faults", ()),
            *(
                storage_fault_view(
                    f.part, f.where, f.reason, datetime.fromtimestamp(f.since, UTC), f.failed_writes
                )
                for f in gw.pipeline.storage.current()
            ),
        ]
        return status

    async def memory_recall(params: RecallParams, ctx: RpcContext) -> dict[str, Any]:
        """What a turn asking ``query`` would recall and inject, without a turn."""
        if user_scoped and not ctx.admin:
            # Like memory.status: a tester for operators, who may name any scope.
            raise _not_allowed("memory.recall")
        recall = await gw.memory.recall_detail(params.query, params.limit, scope_for(ctx, params))
        return {
            "state": recall.state,
            "memories": [
                {"text": m.text, "score": m.score, "node_type": m.node_type}
                for m in recall.memories
            ],
            "section": recall.section,
        }

    async def memory_delete(params: DeleteParams, ctx: RpcContext) -> dict[str, Any]:
        if user_scoped and ctx.admin and params.scope is None and params.user is None:
            # An admin's delete by id: the service's index says whose it is.
            scope = ""
        else:
            scope = scope_for(ctx, params)
        deleted, reason = await gw.memory.delete(params.node_id, scope)
        if deleted or not user_scoped:
            # Shared mode: Philia's answer is the whole story (false: no such node).
            return {"deleted": deleted}
        if not ctx.admin and reason in (NOT_INDEXED, OTHER_SCOPE):
            # Whether the id is another's or nobody's is not the caller's business.
            reason = NOT_YOURS
        return {"deleted": False, "reason": reason}

    def check_others(ctx: RpcContext, what: str) -> None:
        """In user mode, memory that is not the caller's own is an admin's."""
        if user_scoped and not ctx.admin:
            raise _not_allowed(what)

    async def memory_list(params: ListParams, ctx: RpcContext) -> dict[str, Any]:
        contains = params.contains or ""
        if params.anonymous:
            check_others(ctx, "the memory of no principal")
            await gw.pipeline.writebacks_settled("")
            return await gw.memory.list_episodes(
                "", params.limit, params.before or "", anonymous=True, contains=contains
            )
        scope = scope_for(ctx, params)
        # Read-your-write: the turns this process just answered are listed too.
        await gw.pipeline.writebacks_settled(scope)
        return await gw.memory.list_episodes(
            scope, params.limit, params.before or "", contains=contains
        )

    async def memory_forget(params: ForgetParams, ctx: RpcContext) -> dict[str, Any]:
        if params.everything:
            check_others(ctx, "everyone's memory")
            target, settled = ForgetTarget(everything=True), None
        elif params.anonymous:
            check_others(ctx, "the memory of no principal")
            target, settled = ForgetTarget(anonymous=True), ""
        elif params.principal is not None:
            if params.principal != ctx.user:
                check_others(ctx, "another principal's memory")
            target, settled = ForgetTarget(principal=params.principal), None
        else:
            scope = scope_for(ctx, params)
            target, settled = ForgetTarget(scope=scope), scope
        # This process's writebacks into what is forgotten are in memory first.
        await gw.pipeline.writebacks_settled(settled)
        deleted = await gw.memory.forget(target)
        conversations = 0
        if not params.keep_conversations and target.owner != "":
            conversations = await gw.conversations.forget(target.owner)
        return {"deleted": deleted, "conversations": conversations, **forget_report(target)}

    def forget_report(target: ForgetTarget) -> dict[str, Any]:
        """What a forget acted on and, in shared mode, where the turns of no principal are:
        an open REST's turns are nobody's, so a caller's forget does not reach them."""
        if target.everything:
            return {"target": {"everything": True}}
        if target.anonymous:
            return {"target": {"anonymous": True}}
        acted: dict[str, Any] = (
            {"principal": target.principal} if target.principal else {"scope": target.scope}
        )
        if user_scoped:
            return {"target": acted}
        return {"target": acted, "hint": SHARED_FORGET_HINT}

    async def conversations_create(
        params: CreateConversationParams, ctx: RpcContext
    ) -> dict[str, Any]:
        return conversation_view(await gw.conversations.create(ctx.user, params.title))

    async def conversations_get(params: GetConversationParams, ctx: RpcContext) -> dict[str, Any]:
        conversation = await gw.conversations.get(params.conversation_id, ctx.user)
        return await conversation_with_messages(
            gw.conversations, conversation, params.limit, params.before
        )

    async def conversations_list(params: NoParams, ctx: RpcContext) -> dict[str, Any]:
        return {
            "conversations": [conversation_view(c) for c in await gw.conversations.list(ctx.user)]
        }

    async def conversations_delete(params: ConversationParams, ctx: RpcContext) -> dict[str, Any]:
        await gw.conversations.delete(params.conversation_id, ctx.user)
        return {"deleted": True}

    async def usage_summary(params: UsageSummaryParams, ctx: RpcContext) -> dict[str, Any]:
        """Tokens by principal, user, model, backend or day: the caller's own, or (an admin)
        anyone's."""
        usage = gw.usage
        if usage is None:
            raise GatewayError(
                ErrorKind.NOT_CONFIGURED, "usage metering is off (ARONA_USAGE=false)", "usage_off"
            )
        principal: str | None = ctx.user
        if ctx.admin:
            principal = params.principal
        elif params.principal is not None and params.principal != ctx.user:
            raise GatewayError(
                ErrorKind.NOT_ALLOWED,
                "Not allowed: another principal's usage needs an admin token",
                "admin_required",
            )
        when = report.period(params.start, params.to)
        groups = report.group_by(params.group_by)
        summary = await usage.summary(report.query(when, groups, principal))
        result = report.answer(when, groups, summary, principal)
        if principal is not None:
            budget = usage.budget_of(principal)
            if budget is not None:
                spent = await usage.spent_this_month(principal)
                result["budget"] = report.budget_view(budget, spent, month_of(datetime.now(UTC)))
        return result

    def chat_send_refused(websocket: bool) -> None:
        gw.pipeline.metrics.turn("rpc_ws" if websocket else "rpc", DISABLED, "client_error")

    handlers: dict[str, Callable[[Any, RpcContext], Awaitable[Any]]] = {
        CHAT_SEND: chat_send,
        "memory.status": memory_status,
        "memory.recall": memory_recall,
        "memory.delete": memory_delete,
        "memory.list": memory_list,
        "memory.forget": memory_forget,
        "conversations.create": conversations_create,
        "conversations.get": conversations_get,
        "conversations.list": conversations_list,
        "conversations.delete": conversations_delete,
        "usage.summary": usage_summary,
    }
    refused = {"chat.send": chat_send_refused}
    for name, params in METHOD_PARAMS.items():
        dispatcher.register(name, _translated(handlers[name]), params, refused.get(name))
