"""The Philia client against a real (scripted) Philia WebSocket server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import pytest
import pytest_asyncio

from arona_grpc.philia import (
    MAX_REQUEST_BYTES,
    PhiliaClient,
    PhiliaError,
    PhiliaMemory,
    PhiliaRPCError,
    PhiliaTimeout,
    PhiliaTooLarge,
    PhiliaUnavailable,
)
from tests.support.fake_philia import (
    DELETE,
    GREETING,
    HANDSHAKE,
    HEARTBEAT_ACK,
    QUERY,
    STORE,
    FakePhilia,
    Step,
)

TOKEN = "t0k&n=/+ é?%"
FAST = 0.3  # seconds; the per-call deadline in fault tests


def memory(text: str, score: float = 0.5, node_type: str = "episode") -> dict[str, Any]:
    return {"node_type": node_type, "text": text, "score": score}


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakePhilia]:
    async with FakePhilia(token=TOKEN) as server:
        yield server


@pytest_asyncio.fixture
async def client(fake: FakePhilia) -> AsyncIterator[PhiliaClient]:
    c = PhiliaClient(fake.url, TOKEN, timeout_s=FAST)
    yield c
    await c.aclose()


async def assert_recovers(client: PhiliaClient, fake: FakePhilia, upgrades_before: int) -> None:
    """The call after a failure opens a new connection and succeeds."""
    fake.memories = [memory("after the fault")]
    assert await client.query("again", 5) == [PhiliaMemory("after the fault", 0.5, "episode")]
    assert len(fake.upgrades) == upgrades_before + 1


# --- what goes on the wire ---------------------------------------------------------


@pytest.mark.asyncio
async def test_lazy_no_connection_until_first_call(fake: FakePhilia) -> None:
    client = PhiliaClient(fake.url, TOKEN, timeout_s=FAST)
    await client.aclose()
    assert fake.upgrades == []


@pytest.mark.asyncio
async def test_upgrade_url_carries_encoded_token_and_handshake_params(fake: FakePhilia) -> None:
    client = PhiliaClient(fake.url + "?tenant=a%20b", TOKEN, timeout_s=FAST)
    try:
        await client.query("hello", 5)
    finally:
        await client.aclose()

    assert fake.upgrades == [f"/ws?tenant=a%20b&token={quote(TOKEN, safe='')}"]
    assert fake.upgrade_queries() == [{"tenant": ["a b"], "token": [TOKEN]}]
    handshake, query = fake.frames
    assert handshake["method"] == HANDSHAKE
    assert handshake["jsonrpc"] == "2.0"
    assert handshake["params"] == {
        "token": TOKEN,
        "client_type": "cli",
        "capabilities": [],
        "protocol_version": 1,
    }
    assert query["method"] == QUERY
    assert query["params"] == {"query": "hello", "limit": 5}
    assert isinstance(query["id"], str) and query["id"] != handshake["id"]


@pytest.mark.asyncio
async def test_token_appended_with_question_mark_when_url_has_no_query(
    fake: FakePhilia, client: PhiliaClient
) -> None:
    await client.query("q", 5)
    assert fake.upgrades == [f"/ws?token={quote(TOKEN, safe='')}"]


@pytest.mark.asyncio
async def test_query_returns_memories_best_first_and_ignores_extras(
    fake: FakePhilia, client: PhiliaClient
) -> None:
    results = [memory(f"m{i}", 1 - i / 10) | {"unknown": True} for i in range(7)]
    fake.script(QUERY, Step(result={"action": "query", "query": "q", "results": results}))

    got = await client.query("q", 5)

    assert [m.text for m in got] == ["m0", "m1", "m2", "m3", "m4"]
    assert got[1] == PhiliaMemory("m1", 0.9, "episode")
    [frame] = fake.frames_of(QUERY)
    assert frame["params"] == {"query": "q", "limit": 5}


@pytest.mark.asyncio
async def test_store_and_delete_send_their_params(fake: FakePhilia, client: PhiliaClient) -> None:
    node_id = await client.store("User: hi\nAssistant: hello")
    assert node_id == "n-1"
    assert await client.delete(node_id) is True
    assert await client.delete("n-404") is False

    [store] = fake.frames_of(STORE)
    assert store["params"] == {"text": "User: hi\nAssistant: hello", "node_type": "episode"}
    assert [f["params"] for f in fake.frames_of(DELETE)] == [
        {"node_id": "n-1"},
        {"node_id": "n-404"},
    ]
    # All on one connection.
    assert len(fake.upgrades) == 1


@pytest.mark.asyncio
async def test_skips_greeting_heartbeat_and_unrelated_ids(
    fake: FakePhilia, client: PhiliaClient
) -> None:
    unrelated = {"jsonrpc": "2.0", "id": "someone-else", "result": {"results": []}}
    numeric = {"jsonrpc": "2.0", "id": 7, "result": {"deleted": True}}
    fake.script(HANDSHAKE, Step(before=[GREETING]))
    fake.script(QUERY, Step(before=[HEARTBEAT_ACK, unrelated, numeric], result={"results": []}))
    fake.memories = [memory("kept")]

    assert await client.query("q", 5) == []
    assert await client.query("q", 5) == [PhiliaMemory("kept", 0.5, "episode")]
    assert len(fake.upgrades) == 1


# --- failures, and the call after them ----------------------------------------------


@pytest.mark.asyncio
async def test_refused_then_reconnects_when_philia_is_back() -> None:
    fake = await FakePhilia(token=TOKEN).start()
    port = fake.port
    await fake.stop()
    client = PhiliaClient(f"ws://127.0.0.1:{port}/ws", TOKEN, timeout_s=FAST)
    try:
        with pytest.raises(PhiliaUnavailable, match="cannot connect"):
            await client.query("q", 5)
        async with FakePhilia(token=TOKEN, port=port) as back:
            back.memories = [memory("back")]
            assert await client.query("q", 5) == [PhiliaMemory("back", 0.5, "episode")]
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_wrong_token_is_rejected_at_upgrade(fake: FakePhilia) -> None:
    client = PhiliaClient(fake.url, "wrong-token", timeout_s=FAST)
    try:
        with pytest.raises(PhiliaUnavailable, match="HTTP 401") as caught:
            await client.query("q", 5)
    finally:
        await client.aclose()
    assert "wrong-token" not in str(caught.value)
    assert fake.frames == []


@pytest.mark.parametrize(
    "step",
    [
        Step(result={"ok": False, "error": "session limit", "session_id": None}),
        Step(error=(-32005, "Authentication required")),
        Step(result={"unexpected": "shape"}),
        Step(action="close"),
    ],
    ids=["ok-false", "rpc-error", "malformed", "close"],
)
@pytest.mark.asyncio
async def test_handshake_rejected_then_next_call_reconnects(
    fake: FakePhilia, client: PhiliaClient, step: Step
) -> None:
    fake.script(HANDSHAKE, step)
    with pytest.raises(PhiliaUnavailable) as caught:
        await client.query("q", 5)
    assert TOKEN not in str(caught.value)
    assert fake.frames_of(QUERY) == []
    await assert_recovers(client, fake, upgrades_before=1)


@pytest.mark.asyncio
async def test_handshake_without_answer_times_out_then_reconnects(
    fake: FakePhilia, client: PhiliaClient
) -> None:
    fake.script(HANDSHAKE, Step(action="hang"))
    with pytest.raises(PhiliaTimeout):
        await client.query("q", 5)
    await assert_recovers(client, fake, upgrades_before=1)


@pytest.mark.parametrize(
    ("step", "error", "message"),
    [
        (Step(error=(-32603, "handler stalled")), PhiliaRPCError, "-32603: handler stalled"),
        (Step(action="hang"), PhiliaTimeout, "no answer"),
        (Step(action="close"), PhiliaUnavailable, "closed the connection"),
        (Step(action="garbage"), PhiliaUnavailable, "not JSON"),
        (Step(action="garbage", garbage="[1, 2]"), PhiliaUnavailable, "not an object"),
        (Step(action="garbage", garbage=b"\x00\x01"), PhiliaUnavailable, "binary"),
        (
            Step(action="garbage", garbage='{"jsonrpc": "2.0", "id": "x", "result": NaN}'),
            PhiliaUnavailable,
            "not JSON",
        ),
        (Step(result={"results": "nope"}), PhiliaUnavailable, "malformed query result"),
        (Step(result={"results": [{"text": "t"}]}), PhiliaUnavailable, "malformed query result"),
        (Step(result=None), PhiliaUnavailable, "malformed query result"),
    ],
    ids=[
        "rpc-error",
        "no-answer",
        "close-mid-call",
        "garbage",
        "json-array",
        "binary",
        "nan-literal",
        "results-not-a-list",
        "no-score",
        "null-result",
    ],
)
@pytest.mark.asyncio
async def test_call_failure_then_next_call_reconnects(
    fake: FakePhilia, client: PhiliaClient, step: Step, error: type[PhiliaError], message: str
) -> None:
    fake.script(QUERY, step)
    with pytest.raises(error, match=message) as caught:
        await client.query("q", 5)
    assert TOKEN not in str(caught.value)
    await assert_recovers(client, fake, upgrades_before=1)


@pytest.mark.asyncio
async def test_unusual_text_round_trips_both_ways(fake: FakePhilia, client: PhiliaClient) -> None:
    # Non-ASCII, and a lone surrogate (legal escaped JSON the fast codec refuses): the
    # query reaches Philia as sent and the memory comes back as stored, on one link.
    query = "th\u00e9 \U0001f375 \ud800"
    text = "User: caf\u00e9 \udc80\nAssistant: \u2615"
    fake.script(QUERY, Step(result={"results": [memory(text, 0.75)]}))
    assert await client.query(query, 5) == [PhiliaMemory(text, 0.75, "episode")]
    [frame] = fake.frames_of(QUERY)
    assert frame["params"]["query"] == query
    assert len(fake.upgrades) == 1


@pytest.mark.asyncio
async def test_rpc_error_carries_code_and_message(fake: FakePhilia, client: PhiliaClient) -> None:
    fake.script(DELETE, Step(error=(-32602, "node_id is required")))
    with pytest.raises(PhiliaRPCError) as caught:
        await client.delete("")
    assert (caught.value.code, caught.value.message) == (-32602, "node_id is required")


@pytest.mark.asyncio
async def test_idle_close_by_philia_then_next_call_reconnects(
    fake: FakePhilia, client: PhiliaClient
) -> None:
    await client.query("q", 5)
    await fake.close_connections(4000)
    await assert_recovers(client, fake, upgrades_before=1)


@pytest.mark.asyncio
async def test_an_idle_link_is_kept_open_with_heartbeats(fake: FakePhilia) -> None:
    client = PhiliaClient(fake.url, TOKEN, timeout_s=FAST, heartbeat_s=0.05)
    try:
        await client.query("q", 5)
        beats = await fake.wait_frames("Base.Heartbeat", 3)
        # Notifications: nothing to answer, and no caller waits for them.
        assert all(set(beat) == {"jsonrpc", "method"} for beat in beats)
        assert client.pending_calls == 0
        # The next call goes out on the same link: no new connect, no new handshake.
        await client.query("q again", 5)
        assert len(fake.upgrades) == 1
        assert len(fake.frames_of(HANDSHAKE)) == 1
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_late_reply_after_timeout_does_not_answer_next_call(
    fake: FakePhilia, client: PhiliaClient
) -> None:
    fake.script(QUERY, Step(action="hang"))
    with pytest.raises(PhiliaTimeout):
        await client.query("first", 5)
    [first] = fake.frames_of(QUERY)

    # The stale reply comes in just before the real one.
    stale = {"jsonrpc": "2.0", "id": first["id"], "result": {"results": [memory("stale")]}}
    fake.script(QUERY, Step(before=[stale], result={"results": [memory("fresh")]}))

    assert await client.query("second", 5) == [PhiliaMemory("fresh", 0.5, "episode")]


@pytest.mark.asyncio
async def test_reply_for_a_cancelled_call_does_not_answer_the_next(
    fake: FakePhilia, client: PhiliaClient
) -> None:
    await client.query("warm up", 5)
    fake.script(QUERY, Step(action="hang"))
    abandoned = asyncio.create_task(client.query("abandoned", 5))
    [_, first] = await fake.wait_frames(QUERY, 2)
    abandoned.cancel()
    with pytest.raises(asyncio.CancelledError):
        await abandoned

    stale = {"jsonrpc": "2.0", "id": first["id"], "result": {"results": [memory("stale")]}}
    fake.script(QUERY, Step(before=[stale], result={"results": [memory("fresh")]}))
    assert await client.query("next", 5) == [PhiliaMemory("fresh", 0.5, "episode")]
    # A cancelled caller is no fault of the connection: it is kept.
    assert len(fake.upgrades) == 1


@pytest.mark.asyncio
async def test_a_fault_fails_every_pending_call_of_that_connection(
    fake: FakePhilia, client: PhiliaClient
) -> None:
    fake.script(QUERY, Step(action="hang"), Step(action="garbage"))
    first = asyncio.create_task(client.query("one", 5))
    await fake.wait_frames(QUERY, 1)
    second = asyncio.create_task(client.query("two", 5))
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert all(isinstance(r, PhiliaUnavailable) for r in results), results
    await assert_recovers(client, fake, upgrades_before=1)


# --- concurrency -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_concurrent_calls_share_one_connect_and_one_connection(fake: FakePhilia) -> None:
    client = PhiliaClient(fake.url, TOKEN, timeout_s=5)
    gate = asyncio.Event()
    fake.script(HANDSHAKE, Step(gate=gate))
    echo = [Step(result=lambda p: {"results": [memory(p["query"])]}) for _ in range(8)]
    fake.script(QUERY, *echo)
    try:
        calls = [asyncio.create_task(client.query(f"q{i}", 5)) for i in range(8)]
        # Every call is already waiting on the one connect when the handshake arrives.
        await fake.wait_frames(HANDSHAKE)
        gate.set()
        results = await asyncio.gather(*calls)
    finally:
        await client.aclose()

    assert [r[0].text for r in results] == [f"q{i}" for i in range(8)]
    assert len(fake.upgrades) == 1
    assert len(fake.frames_of(HANDSHAKE)) == 1
    assert len({f["id"] for f in fake.frames_of(QUERY)}) == 8


@pytest.mark.asyncio
async def test_replies_out_of_order_reach_their_callers(fake: FakePhilia) -> None:
    client = PhiliaClient(fake.url, TOKEN, timeout_s=5)
    gate = asyncio.Event()
    fake.script(
        QUERY,
        Step(gate=gate, result={"results": [memory("slow")]}),
        Step(result={"results": [memory("fast")]}),
    )
    try:
        slow = asyncio.create_task(client.query("slow", 5))
        await fake.wait_frames(QUERY, 1)
        fast = await client.query("fast", 5)
        gate.set()
        assert [m.text for m in fast] == ["fast"]
        assert [m.text for m in await slow] == ["slow"]
    finally:
        await client.aclose()


# --- lifecycle and secrets ---------------------------------------------------------


@pytest.mark.asyncio
async def test_closed_client_refuses_calls(fake: FakePhilia) -> None:
    client = PhiliaClient(fake.url, TOKEN, timeout_s=FAST)
    await client.query("q", 5)
    await client.aclose()
    with pytest.raises(PhiliaUnavailable, match="closed"):
        await client.query("q", 5)
    assert len(fake.upgrades) == 1


@pytest.mark.asyncio
async def test_aclose_during_connect_leaves_nothing_running(fake: FakePhilia) -> None:
    client = PhiliaClient(fake.url, TOKEN, timeout_s=5)
    fake.script(HANDSHAKE, Step(action="hang"))
    call = asyncio.create_task(client.query("q", 5))
    await fake.wait_frames(HANDSHAKE)
    await client.aclose()
    with pytest.raises(PhiliaError):
        await call


@pytest.mark.asyncio
async def test_token_never_logged_even_at_debug(
    fake: FakePhilia, client: PhiliaClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await client.query("q", 5)
    fake.script(QUERY, Step(action="close"))
    with pytest.raises(PhiliaUnavailable):
        await client.query("q", 5)
    await client.store("text")

    ours = [r for r in caplog.records if not r.name.startswith(FakePhilia.LOGGER)]
    assert any(r.name.startswith("arona_grpc.philia.") for r in ours)  # the client did log
    text = "\n".join(r.getMessage() for r in ours)
    for form in (TOKEN, quote(TOKEN, safe=""), "t0k&n"):
        assert form not in text


# --- calls refused for what they are ------------------------------------------------


@pytest.mark.asyncio
async def test_a_request_over_the_frame_budget_is_not_sent_and_the_link_stays(
    fake: FakePhilia, client: PhiliaClient
) -> None:
    await client.query("warm up", 5)
    with pytest.raises(PhiliaTooLarge, match="over Philia's frame budget") as caught:
        await client.store("x" * MAX_REQUEST_BYTES)
    assert caught.value.permanent and not caught.value.philia_fault
    assert fake.frames_of(STORE) == []
    # The same link serves the next call: nothing was dropped for the other callers.
    await client.query("again", 5)
    assert len(fake.upgrades) == 1


@pytest.mark.asyncio
async def test_invalid_params_is_permanent_and_keeps_the_link(
    fake: FakePhilia, client: PhiliaClient
) -> None:
    fake.script(STORE, Step(error=(-32602, "Invalid params: text must be a non-empty string")))
    with pytest.raises(PhiliaRPCError) as caught:
        await client.store("refused")
    assert (caught.value.permanent, caught.value.philia_fault) == (True, False)
    await client.query("again", 5)
    assert len(fake.upgrades) == 1


@pytest.mark.asyncio
async def test_a_1009_close_fails_the_largest_call_as_too_large_and_blames_nobody_else() -> None:
    # A Philia whose budget is smaller than ours closes the link over the big frame.
    async with FakePhilia(token=TOKEN, max_size=64 * 1024) as small:
        hold = asyncio.Event()
        small.script(QUERY, Step(hold=hold))
        client = PhiliaClient(small.url, TOKEN, timeout_s=5.0)
        try:
            waiting = asyncio.ensure_future(client.query("a small question", 5))
            await small.wait_frames(QUERY)
            with pytest.raises(PhiliaTooLarge, match="close code 1009") as big:
                await client.store("y" * 100_000)
            assert big.value.permanent
            with pytest.raises(PhiliaUnavailable, match="too large") as other:
                await waiting
            assert (other.value.permanent, other.value.philia_fault) == (False, False)
            # The next call connects afresh and works.
            await client.query("again", 5)
            assert len(small.upgrades) == 2
        finally:
            await client.aclose()
