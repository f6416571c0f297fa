"""The one chat-turn pipeline shared by REST, REST SSE and ``chat.send``.

recall -> persist -> forward -> writeback:

1. assemble the context: the stored history of ``conversation_id`` (if any)
   followed by the request's messages;
2. recall memories for the last user message through the gRPC
   ``MemoryService`` and inject them as one message, first or after the client's leading
   system/developer messages (``ARONA_MEMORY_PLACEMENT``), in each backend's role
   (idempotent: a context that already carries an injected section, a message that is
   exactly one, is left alone; a message that merely quotes the header is not one);
3. persist the request's messages to the conversation;
4. forward the turn upstream (whole or streamed);
5. once the reply is complete, persist it and write the turn back as an
   episode in a background task that never blocks or alters the response. A tool loop is
   one turn (gateway_http.tool_loops): a reply calling tools is a step, not written back;
   the loop's final answer is, with the loop's user message. Of several choices (``n``),
   choice 0 is the one kept, streamed or not.

The model is routed before anything else (:class:`~gateway_http.upstream.routing.Router`):
a model no backend serves is refused before recall or persistence. Recall runs once per
turn, whatever the number of backends tried.

On the way it notes what the metrics and the memory headers report: the memories
injected, the recall's time, when the upstream call started, answered and
ended, and every backend attempt (:class:`PreparedTurn`); each surface reports how its
turn ended through :meth:`TurnPipeline.finished`, which also describes the turn on its server
span (opened by the surface: REST in gateway_http.app, ``chat.send`` in routes.rpc). The
writeback's task starts under that span, so its call is in the turn's trace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from arona_common import tracing
from arona_common.database import DatabaseUnavailable
from arona_common.storage import StorageFaults
from gateway_http.conversations import ConversationStore
from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.journal import JOURNAL_COST, JOURNAL_PART, Journal, Journaled
from gateway_http.memory_client import DISABLED, MemoryClient
from gateway_http.messages import (
    is_memory_section,
    last_user_message,
    message_text,
    section_index,
    stored_user_text,
)
from gateway_http.metrics import GatewayMetrics, NoMetrics
from gateway_http.tool_loops import stored_answer
from gateway_http.upstream.routing import MAX_TRACED_MODEL_CHARS, OK, Attempt, Route, Router
from gateway_http.usage.meter import EndedTurn
from gateway_http.usage.metering import Metering
from gateway_http.views import conversation_errors

logger = logging.getLogger(__name__)

RECALL_LIMIT = 5
# The longest a caller's memory.list (or forget) waits for the writebacks of its own turns
# still on their way, so it sees what it just said.
WRITEBACK_SETTLE_S = 5.0


@dataclass
class TurnRequest:
    owner: str
    # The OpenAI request body without the gateway's own fields.
    body: dict[str, Any]
    memory: bool | None = None
    conversation_id: str | None = None
    # Whose memory the turn uses (gateway_http.auth.memory_scope); None without a principal.
    scope: str | None = None
    # time.perf_counter() when the request arrived.
    started: float = field(default_factory=time.perf_counter)


@dataclass
class PreparedTurn:
    request: TurnRequest
    upstream_body: dict[str, Any]
    memory_state: str
    # The text of the last user message of the assembled context ("" when there is none):
    # what was recalled for.
    user_text: str
    # Memories injected, and the time the recall took (0 when there was none).
    memory_count: int = 0
    recall_s: float = 0.0
    # time.perf_counter() when the upstream call started, answered (whole reply or first
    # chunk) and ended; 0 until then.
    upstream_start: float = 0.0
    upstream_first: float = 0.0
    upstream_end: float = 0.0
    # The backends to ask, in order, and each try made so far (the answering one last).
    route: Route = ()
    attempts: list[Attempt] = field(default_factory=list)
    # The memory section injected ("" for none), and the reply as far as it came: what the
    # meter counts when the upstream reports no usage.
    section: str = ""
    # Where the section is in upstream_body["messages"] (None: none was injected).
    section_at: int | None = None
    # What an episode keeps of the user's message: its text, or markers for a message of
    # parts without text (gateway_http.messages.stored_user_text).
    stored_user: str = ""
    reply: StreamedReply | None = None
    reply_message: dict[str, Any] | None = None
    # The turn's server span (REST, or chat.send): what finished() describes, and what the
    # writeback links to. The API's invalid span when tracing is off.
    span: Span = field(default_factory=tracing.current_span)

    @property
    def usage(self) -> dict[str, Any] | None:
        """The ``usage`` the answering backend reported (None when it reported none)."""
        if self.attempts and self.attempts[-1].answered:
            return self.attempts[-1].usage
        return None

    @property
    def backend(self) -> str | None:
        """The backend whose answer the client gets (None before an answer began)."""
        if self.attempts and self.attempts[-1].answered:
            return self.attempts[-1].backend
        return None

    def overhead_s(self, now: float) -> float:
        """The gateway's own time until ``now``, outside the wait for the upstream's answer."""
        waited = self.upstream_first - self.upstream_start if self.upstream_first else 0.0
        return now - self.request.started - waited


@dataclass
class TurnReply:
    completion: dict[str, Any]
    content: str
    finish_reason: str | None
    usage: dict[str, Any] | None


def has_memory_section(messages: list[dict[str, Any]]) -> bool:
    """Whether the context already carries an injected section (then none is added).

    Only a message that is exactly a section counts, in whatever role and place it was
    injected: with the ``echo`` model a conversation's stored assistant replies quote the
    sections they were given, and those must not switch memory off for the rest of the
    conversation.
    """
    return any(is_memory_section(m) for m in messages)


class TurnPipeline:
    def __init__(
        self,
        memory: MemoryClient,
        router: Router,
        conversations: ConversationStore,
        *,
        user_scoped: bool = False,
        journal: Journal | None = None,
        metrics: GatewayMetrics | None = None,
        storage: StorageFaults | None = None,
        usage: Metering | None = None,
        placement: str = "first",
    ) -> None:
        self._memory = memory
        # Where the memory section goes (ARONA_MEMORY_PLACEMENT).
        self._placement = placement
        # This process's files that cannot be written now (the journal): said once, shown
        # by memory.status.
        self.storage = storage or StorageFaults()
        # Usage metering and budgets (None: ARONA_USAGE=false).
        self._usage = usage
        self.metrics = metrics or NoMetrics()
        # Episodes answered but not yet taken by the memory service (durable before answered).
        self._journal = journal
        self._journal_behind = False
        self._replaying: asyncio.Task[None] | None = None
        # Journal entries whose writeback is under way (a replay leaves them alone).
        self._sending: set[int] = set()
        # ARONA_MEMORY_SCOPE=user: a turn without a principal gets no memory at all.
        self._user_scoped = user_scoped
        self._router = router
        self._conversations = conversations
        # asyncio keeps only weak references to tasks: hold them until done.
        self._background: set[asyncio.Task[None]] = set()
        # The writebacks on their way, by scope: a caller's memory.list waits for its own.
        self._writing: dict[str, set[asyncio.Task[None]]] = {}

    async def prepare(self, request: TurnRequest) -> PreparedTurn:
        """Route the model, assemble the context, recall and inject, persist the new messages."""
        model = request.body["model"]
        route = self._router.route(model)
        if route is None:
            raise GatewayError(
                ErrorKind.NOT_FOUND,
                f"The model '{model}' does not exist or no backend serves it",
                "model_not_found",
            )
        if self._usage is not None and self._usage.budgets.active:
            # Before recall and before anything is stored: a refused turn leaves no trace.
            await self._usage.check(request.owner)
        new_messages: list[dict[str, Any]] = request.body["messages"]
        history: list[dict[str, Any]] = []
        if request.conversation_id is not None:
            await self._check_owner(request.conversation_id, request.owner)
            with conversation_errors():
                history = await self._conversations.messages(request.conversation_id)
        messages = [*history, *new_messages]
        # A step of a tool loop ends with tool results: its last user message is the loop's,
        # so every step recalls for it (and is written back with it once the loop ends).
        user_message = last_user_message(messages)
        user_text = message_text(user_message)

        state = DISABLED
        count = 0
        recall_s = 0.0
        section = ""
        section_at: int | None = None
        if (
            request.memory is not False
            and self._has_memory(request)
            and user_text.strip()
            and not has_memory_section(messages)
        ):
            started = time.perf_counter()
            recall = await self._memory.recall(user_text, RECALL_LIMIT, request.scope or "")
            recall_s = time.perf_counter() - started
            self.metrics.recall(recall.state, recall_s)
            state = recall.state
            if recall.section:
                section = recall.section
                # As a system message here; each backend gets it in its own role
                # (routing.Target.body).
                section_at = section_index(messages, self._placement)
                messages.insert(section_at, {"role": "system", "content": section})
                count = recall.count

        if request.conversation_id is not None:
            # Each message whole, as the client sent it (tool calls, tool call ids, parts).
            with conversation_errors():
                await self._conversations.append(request.conversation_id, *new_messages)
        upstream_body = dict(request.body)
        upstream_body["messages"] = messages
        return PreparedTurn(
            request,
            upstream_body,
            state,
            user_text,
            count,
            recall_s,
            route=route,
            section=section,
            section_at=section_at,
            stored_user=stored_user_text(user_message),
        )

    def finished(self, turn: PreparedTurn, surface: str, outcome: str) -> None:
        """Record a turn that ended: its outcome, and for an answered one its timings."""
        metrics = self.metrics
        metrics.turn(surface, turn.memory_state, outcome)
        if turn.span.is_recording():
            _describe(turn, surface, outcome)
        if self._router.routed:
            _log_answer(turn, outcome)
        if outcome == "ok" and turn.upstream_first:
            end = turn.upstream_end or turn.upstream_first
            metrics.first_byte(surface, turn.upstream_first - turn.upstream_start)
            metrics.overhead(
                surface,
                time.perf_counter() - turn.request.started - (end - turn.upstream_start),
            )
        if self._usage is not None and turn.backend is not None:
            self._usage.record(_ended(turn, surface, outcome))

    async def complete(self, turn: PreparedTurn) -> TurnReply:
        """Forward the turn and wait for the whole reply (UpstreamError propagates)."""
        turn.upstream_start = time.perf_counter()
        completion = await self._router.complete(
            turn.route, turn.upstream_body, turn.attempts, turn.section_at
        )
        turn.upstream_first = turn.upstream_end = time.perf_counter()
        choice = first_choice(completion)
        returned = choice.get("message")
        message: dict[str, Any] = returned if isinstance(returned, dict) else {}
        content = message_text(message) if message else ""
        reply = message or {"role": "assistant", "content": content}
        turn.reply_message = reply
        await self._finish(turn, reply, writeback=True)
        usage = completion.get("usage")
        return TurnReply(
            completion,
            content,
            choice.get("finish_reason"),
            usage if isinstance(usage, dict) else None,
        )

    async def stream(self, turn: PreparedTurn, *, writeback: bool) -> AsyncIterator[dict[str, Any]]:
        """Forward the turn streamed, yielding each upstream chunk as it arrives.

        Only a stream that runs to its end counts as a completed reply: a failed
        stream (UpstreamError propagates) or a consumer that stops early persists
        nothing and writes nothing back. Stopping early closes the upstream
        request at once.

        With metering on, the upstream is asked for its usage
        (``stream_options.include_usage``); a client that did not ask for it does not see
        it (the extra chunk is left out, and the ``usage`` member of the others). When the
        client sent no ``stream_options`` at all, a backend that refuses them gets the turn
        without (the router retries it at once and remembers); the meter then estimates.
        """
        reply = turn.reply = StreamedReply()
        body = turn.upstream_body
        strip_usage = False
        if self._usage is not None and not _asks_usage(body):
            body = {**body, "stream_options": {**_stream_options(body), "include_usage": True}}
            strip_usage = True
        # Only the gateway's own stream_options may be dropped: a client's reaches the backend,
        # and the backend's answer to it reaches the client.
        optional = strip_usage and "stream_options" not in turn.upstream_body
        turn.upstream_start = time.perf_counter()
        upstream = self._router.stream(
            turn.route, body, turn.attempts, turn.section_at, usage_optional=optional
        )
        try:
            async for chunk in upstream:
                if not turn.upstream_first:
                    turn.upstream_first = time.perf_counter()
                if strip_usage and "usage" in chunk:
                    del chunk["usage"]
                    if not chunk.get("choices"):
                        continue
                reply.add(chunk)
                yield chunk
        finally:
            await upstream.aclose()
        turn.upstream_end = time.perf_counter()
        await self._finish(turn, reply.message(), writeback=writeback)

    async def drain(self, grace_s: float) -> None:
        """Give pending writebacks up to ``grace_s`` seconds to finish."""
        pending = set(self._background)
        if not pending:
            return
        _, still = await asyncio.wait(pending, timeout=grace_s)
        for task in still:
            task.cancel()
        if still:
            logger.warning("%d writeback(s) did not finish within the grace period", len(still))

    def writes_back(self, request: TurnRequest) -> bool:
        """Whether a completed turn of ``request`` goes to memory: the caller has memory and
        the memory service has not said it stores no writebacks (memory or writeback off)."""
        return self._has_memory(request) and self._memory.writeback_wanted

    def _has_memory(self, request: TurnRequest) -> bool:
        """Whether the turn may recall and write back: always in shared mode, only with a
        scope in user mode."""
        return request.scope is not None or not self._user_scoped

    async def _check_owner(self, conversation_id: str, owner: str) -> None:
        with conversation_errors():
            await self._conversations.get(conversation_id, owner)

    async def _finish(self, turn: PreparedTurn, reply: dict[str, Any], *, writeback: bool) -> None:
        conversation_id = turn.request.conversation_id
        if conversation_id is not None:
            try:
                # The reply as the upstream returned it (tool calls included).
                await self._conversations.append(conversation_id, reply)
            except DatabaseUnavailable as exc:
                # The answer exists; losing its copy in the history must not lose the answer.
                # (The outage is said once, by arona_common.database.)
                logger.debug("the reply was not added to its conversation: %s", exc)
        if not writeback:
            return
        # None: a step of a tool loop (the loop's final answer is stored, with its question).
        content = stored_answer(turn.request.body, reply)
        # A side of markers alone ([image]) is kept only beside an answer.
        if content is not None and (turn.user_text or content) and self.writes_back(turn.request):
            user = turn.stored_user
            scope = turn.request.scope or ""
            # Journaled before the reply's last byte leaves: a hard kill from here on loses
            # nothing.
            entry = self._journal_add(user, content, scope)
            task = asyncio.create_task(self._writeback(user, content, scope, entry))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            writing = self._writing.setdefault(scope, set())
            writing.add(task)
            task.add_done_callback(lambda done: self._written(scope, done))

    def _written(self, scope: str, task: asyncio.Task[None]) -> None:
        writing = self._writing.get(scope)
        if writing is not None:
            writing.discard(task)
            if not writing:
                del self._writing[scope]

    async def writebacks_settled(
        self, scope: str | None, timeout_s: float = WRITEBACK_SETTLE_S
    ) -> None:
        """Wait (at most ``timeout_s``) for this process's writebacks into ``scope`` (None:
        into any scope) that are on their way: read-your-write for a caller listing its
        memories after a turn, or forgetting them.

        The memory service answers a writeback once its episode is in the index, so a list
        made after this shows every turn this process has answered for the scope (unless
        Philia was down and the episode waits in the outbox).
        """
        if scope is None:
            writing = {task for tasks in self._writing.values() for task in tasks}
        else:
            writing = set(self._writing.get(scope, ()))
        if writing:
            await asyncio.wait(writing, timeout=timeout_s)

    async def _writeback(
        self, user: str, assistant: str, scope: str, entry: Journaled | None
    ) -> None:
        if entry is not None:
            self._sending.add(entry.id)
        try:
            # Its failures are logged by the memory client. In the turn's trace: this task
            # started under the turn's span.
            taken = await self._memory.writeback(
                user, assistant, scope, entry.episode_id if entry is not None else ""
            )
        except Exception:
            logger.exception("writeback failed")
            taken = False
        finally:
            if entry is not None:
                self._sending.discard(entry.id)
        if entry is None:
            return
        if not taken:
            self._journal_behind = True
            return
        self._journal_drop(entry.id)
        if self._journal_behind:
            self.replay_journal()

    def _journal_add(self, user: str, assistant: str, scope: str) -> Journaled | None:
        if self._journal is None:
            return None
        try:
            entry = self._journal.add(user, assistant, scope)
        except OSError as exc:
            self.storage.failed(JOURNAL_PART, str(self._journal.path), exc, JOURNAL_COST)
            return None
        self.storage.succeeded(JOURNAL_PART)
        return entry

    def _journal_drop(self, entry: int) -> None:
        assert self._journal is not None
        try:
            self._journal.drop(entry)
        except OSError as exc:
            self.storage.failed(JOURNAL_PART, str(self._journal.path), exc, JOURNAL_COST)

    def replay_journal(self) -> None:
        """Send again what the journal holds (at start, and once the service answers again)."""
        if self._journal is None or (self._replaying is not None and not self._replaying.done()):
            return
        self._journal_behind = False
        # Started from some turn's writeback, but none of that turn's work.
        self._replaying = asyncio.create_task(
            self._replay_journal(), name="journal-replay", context=tracing.untraced_context()
        )
        self._background.add(self._replaying)
        self._replaying.add_done_callback(self._background.discard)

    async def _replay_journal(self) -> None:
        assert self._journal is not None
        left = self._journal.pending()
        if left:
            logger.info("%d journaled episode(s) not yet taken by memory: sending them", len(left))
        for item in left:
            if item.id in self._sending:
                continue
            if not await self._memory.writeback(
                item.user, item.assistant, item.scope, item.episode_id, item.occurred_at
            ):
                # The service is still away: the next successful writeback tries again.
                self._journal_behind = True
                return
            self._journal_drop(item.id)

    async def prepare_response(
        self,
        request: TurnRequest,
        route: Route,
        user_text: str,
        *,
        recall: bool,
        prompt: list[dict[str, Any]],
    ) -> PreparedTurn:
        """A Responses turn (gateway_http.responses) up to its upstream call: the caller's
        budget checked, and memory recalled for ``user_text`` as for a chat turn (``recall``
        False: the request already holds a section). Where the section goes is the caller's
        business; ``prompt`` (the request as chat messages) is what the meter counts when
        the upstream reports no usage."""
        if self._usage is not None and self._usage.budgets.active:
            await self._usage.check(request.owner)
        state = DISABLED
        count = 0
        recall_s = 0.0
        section = ""
        if (
            recall
            and request.memory is not False
            and self._has_memory(request)
            and user_text.strip()
        ):
            started = time.perf_counter()
            recalled = await self._memory.recall(user_text, RECALL_LIMIT, request.scope or "")
            recall_s = time.perf_counter() - started
            self.metrics.recall(recalled.state, recall_s)
            state = recalled.state
            if recalled.section:
                section = recalled.section
                count = recalled.count
        if section:
            # Where a chat turn has it: what the meter counts as memory's share of the prompt.
            prompt = [{"role": "system", "content": section}, *prompt]
        metered = {"model": request.body["model"], "messages": prompt}
        return PreparedTurn(
            request,
            metered,
            state,
            user_text,
            count,
            recall_s,
            route=route,
            section=section,
            stored_user=user_text,
        )

    async def finish_response(self, turn: PreparedTurn, output_text: str) -> None:
        """A Responses turn whose response completed: its reply noted for the meter, and the
        turn (``User: <input text>`` / ``Assistant: <output text>``) journaled and written back
        as a chat turn is."""
        reply = {"role": "assistant", "content": output_text}
        turn.reply_message = reply
        await self._finish(turn, reply, writeback=True)


def _log_answer(turn: PreparedTurn, outcome: str) -> None:
    """The line that says which backend answered a routed turn (or that none did)."""
    attempts = turn.attempts
    if not attempts:
        return
    last = attempts[-1]
    tries = f"{len(attempts)} attempts" if len(attempts) > 1 else "1 attempt"
    if last.outcome == OK:
        logger.info(
            "model %s answered by backend %s as %s (%s, %.1f ms)",
            turn.request.body.get("model"),
            last.backend,
            last.model,
            tries,
            last.latency_s * 1000,
        )
    else:
        logger.warning(
            "model %s: backend %s ended the turn (%s, %s; turn %s)",
            turn.request.body.get("model"),
            last.backend,
            last.outcome,
            tries,
            outcome,
        )


def _describe(turn: PreparedTurn, surface: str, outcome: str) -> None:
    """What the turn's span says of it: how it ended, what memory did, who answered (never
    what was said)."""
    span = turn.span
    model = turn.request.body.get("model")
    span.set_attributes(
        {
            "arona.surface": surface,
            "arona.outcome": outcome,
            "arona.memory": turn.memory_state,
            "arona.memory.count": turn.memory_count,
            "arona.upstream.attempts": len(turn.attempts),
        }
    )
    if isinstance(model, str):
        span.set_attribute("gen_ai.request.model", model[:MAX_TRACED_MODEL_CHARS])
    if turn.backend is not None:
        span.set_attribute("arona.backend", turn.backend)
    if outcome == "upstream_error":
        tracing.failed(span, outcome)


def _stream_options(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("stream_options")
    return options if isinstance(options, dict) else {}


def _asks_usage(body: dict[str, Any]) -> bool:
    return _stream_options(body).get("include_usage") is True


def _ended(turn: PreparedTurn, surface: str, outcome: str) -> EndedTurn:
    """What the meter needs of an answered turn."""
    attempt = turn.attempts[-1]
    request = turn.request
    user = request.body.get("user")
    text, message = "", None
    if attempt.usage is None:
        # Counted by the meter: the reply as far as it came.
        if turn.reply is not None:
            text, message = turn.reply.text, turn.reply.message()
        elif turn.reply_message is not None:
            text, message = message_text(turn.reply_message), turn.reply_message
    return EndedTurn(
        turn_id=os.urandom(16).hex(),
        principal=request.owner,
        user=user if isinstance(user, str) else "",
        model=attempt.model,
        backend=attempt.backend,
        surface=surface,
        outcome=outcome,
        latency_ms=(time.perf_counter() - request.started) * 1000,
        usage=attempt.usage,
        prompt=turn.upstream_body["messages"],
        reply=text,
        reply_message=message,
        section=turn.section,
    )


def first_choice(answer: dict[str, Any]) -> dict[str, Any]:
    """Choice 0 of a reply or a chunk (``{}`` when it has none): the one a turn keeps when
    ``n`` asks for several. A stream's chunk carries one choice, of any index."""
    choices = answer.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                return choice
    return {}


class StreamedReply:
    """The assistant message a stream of chunks adds up to: text and tool calls assembled,
    of choice 0 only (by each chunk's ``index``), as the JSON answer keeps."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._role = "assistant"
        self._calls: dict[int, dict[str, Any]] = {}

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def add(self, chunk: dict[str, Any]) -> None:
        delta = first_choice(chunk).get("delta")
        if not isinstance(delta, dict):
            return
        content = delta.get("content")
        if isinstance(content, str):
            self._parts.append(content)
        if isinstance(delta.get("role"), str):
            self._role = delta["role"]
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for position, part in enumerate(calls):
                if isinstance(part, dict):
                    self._add_call(part, position)

    def _add_call(self, part: dict[str, Any], position: int) -> None:
        index = part.get("index")
        call = self._calls.setdefault(index if isinstance(index, int) else position, {})
        for key in ("id", "type"):
            if isinstance(part.get(key), str):
                call[key] = part[key]
        function = part.get("function")
        if isinstance(function, dict):
            target = call.setdefault("function", {"name": "", "arguments": ""})
            if isinstance(function.get("name"), str):
                target["name"] += function["name"]
            if isinstance(function.get("arguments"), str):
                target["arguments"] += function["arguments"]

    def message(self) -> dict[str, Any]:
        """``{"role", "content"[, "tool_calls"]}`` as a non-streamed reply would carry it."""
        text = self.text
        message: dict[str, Any] = {"role": self._role, "content": text}
        if self._calls:
            message["content"] = text or None
            message["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        return message


def delta_text(chunk: dict[str, Any]) -> str:
    delta = first_choice(chunk).get("delta")
    if isinstance(delta, dict):
        content = delta.get("content")
        if isinstance(content, str):
            return content
    return ""
