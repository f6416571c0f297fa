"""The store over the wire: a real server, a real SQLite file and a real websockets client."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from arona_grpc.philia import PhiliaClient
from arona_store import server as server_module
from arona_store.server import StoreServer
from arona_store.store import MemoryStore
from tests.support.erasure import files_holding

from .conftest import TOKEN, WAIT_S, StoreClient, ws_url

DAY = 86400.0

# -- connection, token and handshake ----------------------------------------------------------


@pytest.mark.asyncio
async def test_url_has_no_token_and_points_at_ws(server: StoreServer) -> None:
    assert server.url == f"ws://127.0.0.1:{server.port}/ws"
    assert server.port > 0
    assert TOKEN not in server.url


@pytest.mark.asyncio
async def test_an_empty_token_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="token"):
        await StoreServer.start(db_path=tmp_path / "s.db", token="")


@pytest.mark.asyncio
async def test_greeting_is_the_first_frame(raw_client: StoreClient) -> None:
    greeting = await raw_client.recv()
    assert greeting["method"] == "Sync.ServerVersion"
    assert "id" not in greeting
    assert isinstance(greeting["params"]["version"], str)
    assert "build_info" in greeting["params"]


@pytest.mark.asyncio
@pytest.mark.parametrize("token", [None, "", "wrong-token", TOKEN + "x"])
async def test_upgrade_without_the_right_token_is_401(
    server: StoreServer, token: str | None
) -> None:
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(server, token), proxy=None, open_timeout=WAIT_S):
            pass
    assert refused.value.response.status_code == 401


@pytest.mark.asyncio
async def test_other_paths_are_404(server: StoreServer) -> None:
    url = ws_url(server).replace("/ws?", "/other?")
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url, proxy=None, open_timeout=WAIT_S):
            pass
    assert refused.value.response.status_code == 404


@pytest.mark.asyncio
async def test_handshake_succeeds_with_a_session(raw_client: StoreClient) -> None:
    result = await raw_client.handshake()
    assert result["ok"] is True
    assert result["error"] is None
    assert result["reconnect"] is False
    uuid.UUID(result["session_id"])


@pytest.mark.asyncio
async def test_handshake_with_a_wrong_token_is_refused_and_closed(
    raw_client: StoreClient,
) -> None:
    result = await raw_client.handshake(token="not-the-token")
    assert result == {"ok": False, "error": "invalid token", "session_id": None, "reconnect": False}
    await asyncio.wait_for(raw_client.ws.wait_closed(), WAIT_S)
    assert raw_client.ws.close_code == 1008
    with pytest.raises(ConnectionClosed):
        await raw_client.request("Sync.MemoryQueryRequest", {"query": "tea"})


@pytest.mark.asyncio
async def test_methods_before_the_handshake_are_refused(raw_client: StoreClient) -> None:
    for method in ("Sync.MemoryQueryRequest", "Sync.MemoryStoreRequest", "No.SuchMethod"):
        reply = await raw_client.request(method, {"query": "tea", "text": "tea"})
        assert reply["error"]["code"] == -32005
    # Nothing was stored by the refused request.
    await raw_client.handshake()
    result = await raw_client.call("Sync.MemoryQueryRequest", {"query": "tea"})
    assert result["total"] == 0


@pytest.mark.asyncio
async def test_heartbeat_is_acknowledged(client: StoreClient) -> None:
    await client.send({"jsonrpc": "2.0", "method": "Base.Heartbeat"})
    ack = await client.recv()
    while ack.get("method") == "Sync.ServerVersion":
        ack = await client.recv()
    assert ack["method"] == "Base.HeartbeatAck"
    assert "id" not in ack
    reply = await client.request("Base.Heartbeat")
    assert "result" in reply
    assert any(frame.get("method") == "Base.HeartbeatAck" for frame in client.skipped)


@pytest.mark.asyncio
async def test_idle_connection_is_closed_with_4000(tmp_path: Path) -> None:
    async with (
        await StoreServer.start(
            db_path=tmp_path / "s.db", token=TOKEN, idle_timeout_s=0.3
        ) as server,
        connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws,
    ):
        # Nothing is sent: the greeting arrives, then the server gives up on the silence.
        await asyncio.wait_for(ws.wait_closed(), WAIT_S)
        assert ws.close_code == 4000
        assert ws.close_reason == "idle timeout"


@pytest.mark.asyncio
async def test_frames_keep_a_connection_alive_past_the_idle_timeout(tmp_path: Path) -> None:
    async with (
        await StoreServer.start(
            db_path=tmp_path / "s.db", token=TOKEN, idle_timeout_s=1.0
        ) as server,
        connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws,
    ):
        client = StoreClient(ws)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await client.handshake()
        # Each heartbeat is answered, so the connection outlives several idle periods as long as
        # frames keep coming (bounded loop; each round trip is awaited, never slept on).
        rounds = 0
        while loop.time() - started < 2.1 and rounds < 1_000_000:
            assert "result" in await client.request("Base.Heartbeat")
            rounds += 1
        assert loop.time() - started >= 2.0  # two idle periods went by
        assert ws.close_code is None


# A heartbeat every tenth of the store's idle timeout: only a 0.9 s stall of the event loop
# (both ends run on it) could let the store close the link; 0.1 s against 0.3 s left 0.2 s.
IDLE_S = 1.0


@pytest.mark.asyncio
@pytest.mark.parametrize("heartbeat_s", [IDLE_S / 10, None], ids=["heartbeats", "no-heartbeats"])
async def test_the_gateways_heartbeats_keep_its_idle_link_open(
    tmp_path: Path, heartbeat_s: float | None
) -> None:
    async with await StoreServer.start(
        db_path=tmp_path / "s.db", token=TOKEN, idle_timeout_s=IDLE_S
    ) as server:
        client = PhiliaClient(server.url, TOKEN, timeout_s=WAIT_S, heartbeat_s=heartbeat_s)
        try:
            await client.query("tea", 5)
            link = client._conn
            assert link is not None
            if heartbeat_s is None:
                # Without them the store closes the quiet link after its idle timeout.
                await asyncio.wait_for(asyncio.shield(link.reader), IDLE_S * 10)
            else:
                # With them the link outlives two and a half idle timeouts with no call at all.
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(link.reader), IDLE_S * 2.5)
            await client.query("tea", 5)
            assert (client._conn is link) is (heartbeat_s is not None)
        finally:
            await client.aclose()


@pytest.mark.asyncio
async def test_oversized_frame_is_refused_by_closing(client: StoreClient) -> None:
    await client.send(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "Sync.MemoryStoreRequest",
            "params": {"text": "x" * (2**20), "node_type": "episode"},
        }
    )
    await asyncio.wait_for(client.ws.wait_closed(), WAIT_S)
    assert client.ws.close_code == 1009


# -- JSON-RPC envelope and errors --------------------------------------------------------------


@pytest.mark.asyncio
async def test_parse_error_has_a_null_id(client: StoreClient) -> None:
    await client.send('{"jsonrpc": "2.0", "id": 5, "method": ')
    reply = await client.reply_to(None)
    assert reply["error"]["code"] == -32700


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("frame", "expected_id"),
    [
        ("[1, 2]", None),
        ('"just a string"', None),
        ('{"jsonrpc": "2.0", "id": true, "method": "Base.Heartbeat"}', None),
        ('{"jsonrpc": "1.0", "id": 3, "method": "Base.Heartbeat"}', 3),
        ('{"jsonrpc": "2.0", "id": "m", "method": 42}', "m"),
        ('{"jsonrpc": "2.0", "id": 4, "method": "Base.Heartbeat", "params": 7}', 4),
    ],
)
async def test_invalid_requests(client: StoreClient, frame: str, expected_id: object) -> None:
    await client.send(frame)
    reply = await client.reply_to(expected_id)
    assert reply["error"]["code"] == -32600


@pytest.mark.asyncio
async def test_binary_frame_is_an_invalid_request(client: StoreClient) -> None:
    await client.ws.send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "x"}).encode())
    reply = await client.reply_to(None)
    assert reply["error"]["code"] == -32600


@pytest.mark.asyncio
async def test_unknown_method(client: StoreClient) -> None:
    reply = await client.request("Sync.NoSuchThing", {})
    assert reply["error"]["code"] == -32601


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("Sync.MemoryQueryRequest", {}),
        ("Sync.MemoryQueryRequest", {"query": 5}),
        ("Sync.MemoryQueryRequest", {"query": "tea", "limit": 0}),
        ("Sync.MemoryQueryRequest", {"query": "tea", "limit": 101}),
        ("Sync.MemoryQueryRequest", {"query": "tea", "limit": "5"}),
        ("Sync.MemoryQueryRequest", {"query": "tea", "limit": True}),
        ("Sync.MemoryQueryRequest", {"query": "tea", "node_type_filter": 3}),
        ("Sync.MemoryQueryRequest", {"query": "tea", "node_type_filter": ""}),
        ("Sync.MemoryQueryRequest", {"query": "tea", "node_type_filter": ["episode"]}),
        ("Sync.MemoryStoreRequest", {"text": "", "node_type": "episode"}),
        ("Sync.MemoryStoreRequest", {"text": "   ", "node_type": "episode"}),
        ("Sync.MemoryStoreRequest", {"node_type": "episode"}),
        ("Sync.MemoryStoreRequest", {"text": "tea", "node_type": 3}),
        ("Sync.MemoryStoreRequest", {"text": "tea", "properties": {"a": 1}}),
        ("Sync.MemoryStoreRequest", {"text": "tea", "related_node_ids": "x"}),
        # `occurred_at` must be an RFC 3339 time with its offset, within the store's range.
        ("Sync.MemoryStoreRequest", {"text": "tea", "properties": {"occurred_at": "yesterday"}}),
        ("Sync.MemoryStoreRequest", {"text": "tea", "properties": {"occurred_at": "2023-05-08"}}),
        (
            "Sync.MemoryStoreRequest",
            {"text": "tea", "properties": {"occurred_at": "2023-05-08T13:56:00"}},
        ),
        (
            "Sync.MemoryStoreRequest",
            {"text": "tea", "properties": {"occurred_at": "20230508T135600Z"}},
        ),
        (
            "Sync.MemoryStoreRequest",
            {"text": "tea", "properties": {"occurred_at": "9999-01-01T00:00:00Z"}},
        ),
        ("Sync.MemoryDeleteRequest", {}),
        ("Sync.MemoryDeleteRequest", {"node_id": 12}),
    ],
)
async def test_invalid_params(client: StoreClient, method: str, params: dict[str, object]) -> None:
    reply = await client.request(method, params)
    assert reply["error"]["code"] == -32602
    assert "Traceback" not in reply["error"]["message"]
    # The connection stays usable after a refused request.
    assert (await client.call("Sync.MemoryQueryRequest", {"query": "tea"}))["total"] == 0


@pytest.mark.asyncio
async def test_positional_params_are_invalid_params(client: StoreClient) -> None:
    await client.send(
        {"jsonrpc": "2.0", "id": 9, "method": "Sync.MemoryQueryRequest", "params": ["tea", 5]}
    )
    reply = await client.reply_to(9)
    assert reply["error"]["code"] == -32602


@pytest.mark.asyncio
@pytest.mark.parametrize("request_id", [7, "7", "c0ffee-id", 0, -3])
async def test_ids_are_echoed_with_their_type(client: StoreClient, request_id: object) -> None:
    await client.send(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "Sync.MemoryQueryRequest",
            "params": {"query": "tea"},
        }
    )
    reply = await client.reply_to(request_id)
    assert type(reply["id"]) is type(request_id)
    assert reply["result"]["total"] == 0


@pytest.mark.asyncio
async def test_notifications_get_no_reply_but_are_carried_out(client: StoreClient) -> None:
    await client.send(
        {
            "jsonrpc": "2.0",
            "method": "Sync.MemoryStoreRequest",
            "params": {"text": "the heron nests by the lake", "node_type": "episode"},
        }
    )
    await client.send({"jsonrpc": "2.0", "method": "No.SuchNotification"})
    # The very next reply is the one for this request: the notifications produced nothing.
    # Stores are committed in the order they arrive, so once this one is answered the
    # notified one is stored too.
    await client.send(
        {
            "jsonrpc": "2.0",
            "id": "s",
            "method": "Sync.MemoryStoreRequest",
            "params": {"text": "the heron flies at dawn", "node_type": "episode"},
        }
    )
    reply = await client.recv()
    assert reply["id"] == "s"
    found = await client.call("Sync.MemoryQueryRequest", {"query": "heron"})
    assert found["total"] == 2


# -- memory methods -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_store_query_delete_round_trip(client: StoreClient) -> None:
    stored = await client.call(
        "Sync.MemoryStoreRequest",
        {
            "text": "User: I prefer oolong tea\nAssistant: Noted!",
            "node_type": "episode",
            "properties": {"source": "chat"},
            "related_node_ids": [],
        },
    )
    node_id = stored["node_id"]
    uuid.UUID(node_id)

    found = await client.call("Sync.MemoryQueryRequest", {"query": "what tea do I like?"})
    assert found["query"] == "what tea do I like?"
    assert found["total"] == 1
    assert found["results"][0]["text"] == "User: I prefer oolong tea\nAssistant: Noted!"
    assert found["results"][0]["node_type"] == "episode"
    assert 0.0 <= found["results"][0]["score"] <= 1.0

    assert await client.call("Sync.MemoryDeleteRequest", {"node_id": node_id}) == {"deleted": True}
    gone = await client.call("Sync.MemoryQueryRequest", {"query": "oolong tea"})
    assert gone == {"query": "oolong tea", "total": 0, "results": []}
    assert await client.call("Sync.MemoryDeleteRequest", {"node_id": node_id}) == {"deleted": False}


@pytest.mark.asyncio
async def test_the_same_episode_stored_again_is_one_memory(client: StoreClient) -> None:
    episode = {"text": "User: my cat is Miso\nAssistant: Noted!", "node_type": "episode"}
    other = {"text": "User: my cat likes tuna\nAssistant: Noted!", "node_type": "episode"}
    first = (await client.call("Sync.MemoryStoreRequest", episode))["node_id"]
    between = (await client.call("Sync.MemoryStoreRequest", other))["node_id"]
    again = (await client.call("Sync.MemoryStoreRequest", episode))["node_id"]
    assert again == first != between

    found = await client.call("Sync.MemoryQueryRequest", {"query": "my cat", "limit": 5})
    # One copy, and it ranks as the most recent of the two.
    assert [r["text"] for r in found["results"]] == [episode["text"], other["text"]]
    assert await client.call("Sync.MemoryDeleteRequest", {"node_id": first}) == {"deleted": True}
    left = await client.call("Sync.MemoryQueryRequest", {"query": "my cat", "limit": 5})
    assert [r["text"] for r in left["results"]] == [other["text"]]


@pytest.mark.asyncio
async def test_a_memory_stored_with_occurred_at_has_that_time(
    server: StoreServer, client: StoreClient
) -> None:
    # Stored last, but it happened long ago: the memory told today ranks before it.
    await client.call("Sync.MemoryStoreRequest", {"text": "my cat is named Tofu"})
    old = await client.call(
        "Sync.MemoryStoreRequest",
        {"text": "my cat is named Miso", "properties": {"occurred_at": "2023-05-08T13:56:00Z"}},
    )
    offset = await client.call(
        "Sync.MemoryStoreRequest",
        {"text": "my dog is Rex", "properties": {"occurred_at": "2024-01-02T03:04:05+02:00"}},
    )
    found = await client.call("Sync.MemoryQueryRequest", {"query": "my cat"})
    texts = [r["text"] for r in found["results"]]
    assert texts[:2] == ["my cat is named Tofu", "my cat is named Miso"]
    times = {hit.text: hit.created_at for hit in server.store.query("cat dog Rex", limit=5)}
    assert times["my cat is named Miso"] == 1683554160.0  # 2023-05-08T13:56:00Z
    assert times["my dog is Rex"] == 1704157445.0  # 2024-01-02T01:04:05Z
    assert abs(times["my cat is named Tofu"] - time.time()) < 600
    assert old["node_id"] != offset["node_id"]


@pytest.mark.asyncio
async def test_delete_of_an_unknown_id_is_false(client: StoreClient) -> None:
    for node_id in (str(uuid.uuid4()), "not-even-a-uuid"):
        result = await client.call("Sync.MemoryDeleteRequest", {"node_id": node_id})
        assert result == {"deleted": False}


@pytest.mark.asyncio
async def test_memories_survive_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "data" / "store.db"
    async with await StoreServer.start(db_path=db, token=TOKEN) as first:
        async with connect(ws_url(first), proxy=None, open_timeout=WAIT_S) as ws:
            client = StoreClient(ws)
            await client.handshake()
            await client.call(
                "Sync.MemoryStoreRequest", {"text": "I live in Lyon", "node_type": "episode"}
            )
    async with await StoreServer.start(db_path=db, token=TOKEN) as second:
        async with connect(ws_url(second), proxy=None, open_timeout=WAIT_S) as ws:
            client = StoreClient(ws)
            await client.handshake()
            result = await client.call("Sync.MemoryQueryRequest", {"query": "where is Lyon?"})
    assert [r["text"] for r in result["results"]] == ["I live in Lyon"]


def _seed(db: Path) -> None:
    """Memories with known ages, written through the Python API before the server starts."""
    now = time.time()
    store = MemoryStore.open(db)
    try:
        # Filler so that every query word is rare (FTS5 gives no weight to common words).
        store.add_many(
            (f"note number {i} about errands and chores", "episode", now - DAY) for i in range(20)
        )
        store.add("I prefer oolong tea every morning", "episode", now - 2 * DAY)
        store.add("green tea is fine too", "episode", now - 2 * DAY)
        # Same wording and length, so the same relevance: only age tells them apart. The newer
        # one is inserted first so insertion order cannot be what ranks it first.
        store.add("my cat is named Miso", "episode", now - 1 * DAY)
        store.add("my cat is named Tofu", "episode", now - 40 * DAY)
    finally:
        store.close()


@pytest.mark.asyncio
async def test_ranking_relevance_then_recency(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    _seed(db)
    async with (
        await StoreServer.start(db_path=db, token=TOKEN) as server,
        connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws,
    ):
        client = StoreClient(ws)
        await client.handshake()
        tea = await client.call("Sync.MemoryQueryRequest", {"query": "oolong tea", "limit": 5})
        cats = await client.call("Sync.MemoryQueryRequest", {"query": "my cat"})
        one = await client.call("Sync.MemoryQueryRequest", {"query": "cat", "limit": 1})

    # Then the memories stored around them, found through their context only.
    assert [r["text"] for r in tea["results"]][:2] == [
        "I prefer oolong tea every morning",
        "green tea is fine too",
    ]
    assert [r["text"] for r in cats["results"]][:2] == [
        "my cat is named Miso",
        "my cat is named Tofu",
    ]
    assert [r["text"] for r in one["results"]] == ["my cat is named Miso"]
    for result in (tea, cats):
        scores = [r["score"] for r in result["results"]]
        assert scores == sorted(scores, reverse=True)
        assert all(0.0 <= s <= 1.0 for s in scores)
        assert all(isinstance(s, float) for s in scores)
    assert tea["results"][0]["score"] > tea["results"][1]["score"]
    assert cats["results"][0]["score"] > cats["results"][1]["score"]


@pytest.mark.asyncio
async def test_queries_without_a_matching_word_return_nothing(client: StoreClient) -> None:
    await client.call("Sync.MemoryStoreRequest", {"text": "I prefer oolong tea", "node_type": "e"})
    for query in ("volcano submarine", "what is it that you are?", "", "   ", "?!.", '"', "*"):
        result = await client.call("Sync.MemoryQueryRequest", {"query": query})
        assert result == {"query": query, "total": 0, "results": []}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "query",
    [
        '" tea',
        'tea"',
        "tea*",
        "(tea",
        "tea)",
        "NEAR(tea oolong)",
        "NEAR/2 tea",
        "-tea",
        "tea -oolong",
        "text:tea",
        "tea:",
        "^tea",
        "tea AND",
        "OR tea",
        "NOT tea",
        "{text}: tea",
        "tea + oolong",
        "tea's",
        "tea_time",
        "'tea'",
        "tea\x00oolong",
        "茶 tea",
    ],
)
async def test_fts_syntax_in_queries_never_errors(client: StoreClient, query: str) -> None:
    await client.call("Sync.MemoryStoreRequest", {"text": "I prefer oolong tea", "node_type": "e"})
    result = await client.call("Sync.MemoryQueryRequest", {"query": query})
    # Every one of these still holds the word "tea", so the memory is found.
    assert [r["text"] for r in result["results"]] == ["I prefer oolong tea"]


@pytest.mark.asyncio
async def test_limit_caps_the_results(client: StoreClient) -> None:
    for i in range(12):
        await client.call(
            "Sync.MemoryStoreRequest", {"text": f"walk number {i} in the park", "node_type": "e"}
        )
    default = await client.call("Sync.MemoryQueryRequest", {"query": "park walk"})
    three = await client.call("Sync.MemoryQueryRequest", {"query": "park walk", "limit": 3})
    assert default["total"] == 10 and len(default["results"]) == 10
    assert three["total"] == 3 and len(three["results"]) == 3


@pytest.mark.asyncio
async def test_a_recall_does_not_wait_behind_a_store_sent_before_it(
    server: StoreServer, client: StoreClient
) -> None:
    await client.call("Sync.MemoryStoreRequest", {"text": "I prefer oolong tea", "node_type": "e"})
    # Stands in for a slow write: the next store has to wait for the writer.
    assert server.store._lock.acquire(timeout=WAIT_S)
    released = False
    try:
        store = {"text": "I prefer green tea", "node_type": "e"}
        await client.send(
            {"jsonrpc": "2.0", "id": "w", "method": "Sync.MemoryStoreRequest", "params": store}
        )
        await client.send(
            {
                "jsonrpc": "2.0",
                "id": "q",
                "method": "Sync.MemoryQueryRequest",
                "params": {"query": "tea"},
            }
        )
        first = await client.recv()
        assert first["id"] == "q"
        assert [r["text"] for r in first["result"]["results"]] == ["I prefer oolong tea"]
        server.store._lock.release()
        released = True
        stored = await client.recv()
        assert stored["id"] == "w" and "node_id" in stored["result"]
    finally:
        if not released:
            server.store._lock.release()
    found = await client.call("Sync.MemoryQueryRequest", {"query": "green tea"})
    assert found["results"][0]["text"] == "I prefer green tea"


@pytest.mark.asyncio
async def test_stores_sent_together_are_all_answered_and_kept(client: StoreClient) -> None:
    for i in range(20):
        await client.send(
            {
                "jsonrpc": "2.0",
                "id": i,
                "method": "Sync.MemoryStoreRequest",
                "params": {"text": f"lantern number {i}", "node_type": "episode"},
            }
        )
    replies = [await client.recv() for _ in range(20)]
    assert sorted(r["id"] for r in replies) == list(range(20))
    assert len({r["result"]["node_id"] for r in replies}) == 20
    found = await client.call("Sync.MemoryQueryRequest", {"query": "lantern", "limit": 50})
    assert sorted(r["text"] for r in found["results"]) == sorted(
        f"lantern number {i}" for i in range(20)
    )


@pytest.mark.asyncio
async def test_the_log_is_checkpointed_into_the_database_as_stores_come_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "CHECKPOINT_COMMITS", 5)
    db = tmp_path / "ckpt.db"
    async with await StoreServer.start(db_path=db, token=TOKEN) as server:
        size = db.stat().st_size
        async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws:
            client = StoreClient(ws)
            await client.handshake()
            for i in range(5):  # one at a time: five transactions
                text = f"lantern {i} " + "glows softly " * 30
                await client.call("Sync.MemoryStoreRequest", {"text": text, "node_type": "e"})
            assert server._checkpointing is not None
            await asyncio.wait_for(server._checkpointing, WAIT_S)
            assert db.stat().st_size > size  # the pages left the log for the database file
            found = await client.call("Sync.MemoryQueryRequest", {"query": "lantern", "limit": 10})
            assert found["total"] == 5


@pytest.mark.asyncio
async def test_a_recall_waiting_for_a_busy_store_never_stalls_other_clients(
    server: StoreServer, client: StoreClient
) -> None:
    await client.call("Sync.MemoryStoreRequest", {"text": "I prefer oolong tea", "node_type": "e"})
    async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws:
        other = StoreClient(ws)
        await other.handshake()
        # Stands in for a recall from another thread holding the reader.
        assert server.store._read_lock.acquire(timeout=WAIT_S)
        try:
            await client.send(
                {
                    "jsonrpc": "2.0",
                    "id": "held",
                    "method": "Sync.MemoryQueryRequest",
                    "params": {"query": "oolong"},
                }
            )
            assert await other.call("Base.Heartbeat", {}) == {"ok": True}
        finally:
            server.store._read_lock.release()
        reply = await client.reply_to("held")
    assert [r["text"] for r in reply["result"]["results"]] == ["I prefer oolong tea"]


# -- operations -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_stop_closes_open_connections(tmp_path: Path) -> None:
    server = await StoreServer.start(db_path=tmp_path / "s.db", token=TOKEN)
    async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws:
        client = StoreClient(ws)
        await client.handshake()
        await asyncio.wait_for(server.stop(), WAIT_S)
        await asyncio.wait_for(ws.wait_closed(), WAIT_S)
    assert ws.close_code == 1001
    await server.stop()  # idempotent
    with pytest.raises(OSError):
        async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S):
            pass


@pytest.mark.asyncio
async def test_serve_forever_runs_until_cancelled(tmp_path: Path) -> None:
    from arona_store.server import serve_forever

    ready: asyncio.Future[StoreServer] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_forever(db_path=tmp_path / "s.db", token=TOKEN, port=0, on_ready=ready.set_result)
    )
    server = await asyncio.wait_for(ready, WAIT_S)
    async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws:
        assert (await StoreClient(ws).handshake())["ok"] is True
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT_S)
    await asyncio.wait_for(server.wait_stopped(), WAIT_S)
    with pytest.raises(OSError):
        async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S):
            pass


@pytest.mark.asyncio
async def test_logs_never_contain_the_token(
    server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws:
        client = StoreClient(ws)
        await client.handshake()
        await client.call("Sync.MemoryStoreRequest", {"text": "a private note", "node_type": "e"})
    with pytest.raises(InvalidStatus):
        async with connect(ws_url(server, "guess-" + TOKEN), proxy=None, open_timeout=WAIT_S):
            pass
    async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws:
        await StoreClient(ws).handshake(token=TOKEN + "-wrong")
    # The test's own client logs its request line, token included; only the server is checked.
    server_records = [r for r in caplog.records if r.name.startswith(("arona_store", "aiohttp"))]
    text = "\n".join(record.getMessage() for record in server_records)
    assert "refused an upgrade" in text
    for secret in (TOKEN, "s3cret%2Btok%2Fen%3DZq9", "s3cret", "a private note"):
        assert secret not in text


@pytest.mark.asyncio
async def test_node_type_filter_keeps_exactly_that_node_type(client: StoreClient) -> None:
    for text, node_type in (
        ("Alice drinks oolong tea", "episode:aaaa"),
        ("Bob drinks green tea", "episode:bbbb"),
        ("tea is a drink", "episode"),
        ("Alice also likes jasmine tea", "episode:aaaa"),
    ):
        await client.call("Sync.MemoryStoreRequest", {"text": text, "node_type": node_type})
    everything = await client.call("Sync.MemoryQueryRequest", {"query": "tea", "limit": 10})
    assert everything["total"] == 4
    alice = await client.call(
        "Sync.MemoryQueryRequest",
        {"query": "tea", "limit": 10, "node_type_filter": "episode:aaaa"},
    )
    assert sorted(r["text"] for r in alice["results"]) == [
        "Alice also likes jasmine tea",
        "Alice drinks oolong tea",
    ]
    assert {r["node_type"] for r in alice["results"]} == {"episode:aaaa"}
    # The filter is exact: neither a prefix nor the plain type matches more.
    for node_type, expected in (("episode", ["tea is a drink"]), ("episode:a", [])):
        reply = await client.call(
            "Sync.MemoryQueryRequest", {"query": "tea", "node_type_filter": node_type}
        )
        assert [r["text"] for r in reply["results"]] == expected
    # A null filter is no filter.
    unfiltered = await client.call(
        "Sync.MemoryQueryRequest", {"query": "tea", "limit": 10, "node_type_filter": None}
    )
    assert unfiltered["total"] == 4


@pytest.mark.asyncio
async def test_many_deletes_at_once_are_all_answered_and_erased(
    server: StoreServer, tmp_path: Path
) -> None:
    # A forget sends its deletes together: each is answered once its memory is in no file of
    # the store, however many come at once (they share the erasures).
    words = [f"Quillfeather{i:03d}" for i in range(60)]
    client = PhiliaClient(server.url, TOKEN, timeout_s=WAIT_S)
    try:
        ids = await asyncio.gather(*(client.store(f"My token word is {w}") for w in words))
        await client.store("Something to keep: the Marrowlight lamp")
        server.store.checkpoint()
        assert files_holding(tmp_path, words[:1])
        deleted = await asyncio.gather(*(client.delete(node_id) for node_id in ids))
        assert deleted == [True] * len(ids)
        assert files_holding(tmp_path, words) == {}
        assert (await client.query("Marrowlight", 5))[0].text.endswith("Marrowlight lamp")
    finally:
        await client.aclose()
