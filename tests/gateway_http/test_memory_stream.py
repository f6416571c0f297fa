"""Recall and writeback over ``MemoryService/Exchange`` streams, against real services.

Each replica is a real grpc.aio ``MemoryService`` on loopback talking to one scripted
Philia; the HTTP layer's :class:`MemoryClient` reaches them through a :class:`StreamPool`.
Budgets are long (60 s) wherever a test proves that something did *not* wait for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc.config import Settings
from arona_grpc.server import GrpcServer, build_server
from arona_grpc.service import EventKind, MemoryDomain
from arona_grpc.servicer import MemoryServicer
from gateway_http.grpc_channel import (
    Replica,
    ReplicaWatch,
    open_memory_channel,
    resolve_replicas,
)
from gateway_http.memory_client import ENABLED, OFFLINE, MemoryClient
from gateway_http.memory_stream import CallFailed, StreamPool
from tests.support.fake_philia import QUERY, STORE, FakePhilia, Step

pytestmark = pytest.mark.asyncio

TOKEN = "philia-token"
OOLONG = {"text": "I prefer oolong tea", "score": 0.83, "node_type": "entity"}
# Far above anything a call takes here: a call that ends well before it did not wait for it.
LONG_BUDGET_S = 60.0


@dataclasses.dataclass
class Pool:
    philia: FakePhilia
    servers: list[GrpcServer]
    channels: list[grpc.aio.Channel]
    streams: StreamPool
    client: MemoryClient

    def recalls_served(self, server: GrpcServer) -> list[str]:
        return _recalls(server)


def _recalls(server: GrpcServer) -> list[str]:
    """The queries ``server`` recalled, oldest first."""
    events = server.domain.status(100).events
    return [e.detail for e in reversed(events) if e.kind == EventKind.RECALL]


def _settings(
    philia: FakePhilia, data_dir: Path, host: str = "127.0.0.1", port: int = 0
) -> Settings:
    return Settings(
        memory_url=philia.url,
        memory_token=TOKEN,
        memory_timeout_s=LONG_BUDGET_S,
        grpc_host=host,
        grpc_port=port,
        data_dir=data_dir,
    )


@contextlib.asynccontextmanager
async def pool_of(
    tmp_path: Path,
    replicas: int = 1,
    per_channel: int = 1,
    *,
    targets: Sequence[Replica] | None = None,
    servers: Sequence[tuple[str, int]] = (),
) -> AsyncIterator[Pool]:
    """``replicas`` services on 127.0.0.1 (or at ``servers``' host/port), one Philia, and a
    client whose pool reaches them (through ``targets`` when given)."""
    async with FakePhilia(token=TOKEN) as philia:
        philia.memories = [dict(OOLONG)]
        addresses = list(servers) or [("127.0.0.1", 0)] * replicas
        started: list[GrpcServer] = []
        channels: list[grpc.aio.Channel] = []
        streams: StreamPool | None = None
        try:
            for index, (host, port) in enumerate(addresses):
                settings = _settings(philia, tmp_path / f"replica-{index}", host, port)
                started.append(await GrpcServer.start(settings))
            settings = _settings(philia, tmp_path / "http")
            chosen = targets or [Replica(server.target) for server in started]
            channels = [open_memory_channel(settings, replica) for replica in chosen]
            streams = StreamPool(channels, per_channel)
            client = MemoryClient(
                channels[0],
                recall_budget_s=LONG_BUDGET_S,
                rpc_timeout_s=LONG_BUDGET_S,
                streams=streams,
            )
            yield Pool(philia, started, channels, streams, client)
        finally:
            if streams is not None:
                streams.close()
            for channel in channels:
                await channel.close(grace=None)
            for server in started:
                await server.stop(0)


async def test_each_call_has_its_own_deadline_and_a_slow_call_holds_up_no_other(
    tmp_path: Path,
) -> None:
    async with pool_of(tmp_path) as p:
        p.philia.script(QUERY, Step(action="hang"))
        stream = await p.streams.stream(LONG_BUDGET_S)

        slow_id, call = stream.start(1.0)
        call.recall.query = "what did I say about tea?"
        slow_started = time.monotonic()
        slow = asyncio.create_task(stream.reply(slow_id, 1.0))
        await p.philia.wait_frames(QUERY, 1)

        # A second call on the same stream, Philia answering it at once.
        fast_id, call = stream.start(LONG_BUDGET_S)
        call.recall.query = "which tea do I like?"
        fast = await stream.reply(fast_id, LONG_BUDGET_S)
        assert fast.recall.state == pb.MEMORY_STATE_ENABLED
        assert "oolong" in fast.recall.section
        assert not slow.done()

        # The slow one ends at its own deadline, not at the other call's: the service answers
        # OFFLINE just before it, or (on a loaded machine) the caller's own timer fires first,
        # as a unary call's deadline would.
        try:
            reply = await slow
            assert reply.recall.state == pb.MEMORY_STATE_OFFLINE
        except CallFailed as failed:
            assert failed.code == grpc.StatusCode.DEADLINE_EXCEEDED
        waited = time.monotonic() - slow_started
        assert 0.5 <= waited < LONG_BUDGET_S / 2

        # A writeback past its deadline fails as a unary call would: DEADLINE_EXCEEDED.
        p.philia.script(STORE, Step(action="hang"))
        late_id, call = stream.start(1.0)
        call.writeback.user = "remember this"
        call.writeback.assistant = "noted"
        with pytest.raises(CallFailed) as failed:
            await stream.reply(late_id, 1.0)
        assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # The stream is still good for the next call.
        assert (await p.client.recall("tea again?")).state == ENABLED


async def test_a_cancelled_turn_cancels_its_call_on_the_service(tmp_path: Path) -> None:
    async with pool_of(tmp_path) as p:
        release = asyncio.Event()
        p.philia.script(QUERY, Step(hold=release))
        turn = asyncio.create_task(p.client.recall("the cancelled question"))
        await p.philia.wait_frames(QUERY, 1)
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn

        # The cancellation travels on the stream ahead of the next call.
        assert (await p.client.recall("the next question")).state == ENABLED
        release.set()
        await p.philia.wait_answered(2)  # the first query's late answer has gone out
        assert (await p.client.recall("one more question")).state == ENABLED

        # The service stopped the cancelled recall: its late answer was not recorded.
        served = p.recalls_served(p.servers[0])
        assert served == ["the next question", "one more question"]


async def test_a_torn_down_stream_fails_its_calls_at_once_and_is_opened_again(
    tmp_path: Path,
) -> None:
    async with pool_of(tmp_path) as p:
        p.philia.script(QUERY, Step(action="hang"), Step(action="hang"))
        started = time.monotonic()
        pending = [asyncio.create_task(p.client.recall(f"question {i}")) for i in range(2)]
        await p.philia.wait_frames(QUERY, 2)

        server = p.servers[0]
        await server.stop(0)
        outcomes = await asyncio.gather(*pending)
        assert [o.state for o in outcomes] == [OFFLINE, OFFLINE]
        assert time.monotonic() - started < LONG_BUDGET_S / 2

        # The service comes back on the same address: the next call opens a new stream.
        settings = _settings(p.philia, tmp_path / "again", port=server.port)
        p.servers[0] = await GrpcServer.start(settings)
        await asyncio.wait_for(p.channels[0].channel_ready(), LONG_BUDGET_S)
        assert (await p.client.recall("back again?")).state == ENABLED


async def test_calls_are_spread_over_two_replicas(tmp_path: Path) -> None:
    async with pool_of(tmp_path, replicas=2) as p:
        assert await p.streams.wait_open(LONG_BUDGET_S) == 2
        for i in range(20):
            assert (await p.client.recall(f"question {i}")).state == ENABLED
        first, second = (len(p.recalls_served(s)) for s in p.servers)
        assert first + second == 20
        assert first >= 5 and second >= 5, (first, second)


async def test_a_lost_replica_fails_its_calls_and_the_next_ones_move(tmp_path: Path) -> None:
    async with pool_of(tmp_path, replicas=2) as p:
        assert await p.streams.wait_open(LONG_BUDGET_S) == 2
        release = asyncio.Event()
        p.philia.script(QUERY, *(Step(hold=release) for _ in range(4)))
        started = time.monotonic()
        in_flight = [asyncio.create_task(p.client.recall(f"question {i}")) for i in range(4)]
        await p.philia.wait_frames(QUERY, 4)

        lost, kept = p.servers
        await lost.stop(0)
        release.set()
        states = sorted(o.state for o in await asyncio.gather(*in_flight))
        # The lost replica's calls went offline at once; the other's were answered.
        assert states == [ENABLED, ENABLED, OFFLINE, OFFLINE]
        assert time.monotonic() - started < LONG_BUDGET_S / 2

        for i in range(6):
            assert (await p.client.recall(f"later question {i}")).state == ENABLED
        assert p.recalls_served(kept)[-6:] == [f"later question {i}" for i in range(6)]


async def _free_port(tmp_path: Path) -> int:
    """A port free on 127.0.0.1 (a replica picks it), for replicas on both loopbacks."""
    async with FakePhilia(token=TOKEN) as probe_philia:
        probe = await GrpcServer.start(_settings(probe_philia, tmp_path / "probe"))
        port = probe.port
        await probe.stop(0)
    return port


async def test_a_name_with_two_addresses_is_two_replicas(tmp_path: Path) -> None:
    port = await _free_port(tmp_path)

    async def resolve(host: str, port: int) -> list[str]:
        assert host == "memory.internal"
        return ["127.0.0.1", "::1", "127.0.0.1"]

    replicas = await resolve_replicas([f"memory.internal:{port}"], resolve)
    assert replicas == [
        Replica(f"ipv4:127.0.0.1:{port}", f"memory.internal:{port}"),
        Replica(f"ipv6:[::1]:{port}", f"memory.internal:{port}"),
    ]
    servers = [("127.0.0.1", port), ("::1", port)]
    async with pool_of(tmp_path, targets=replicas, servers=servers) as p:
        assert await p.streams.wait_open(LONG_BUDGET_S) == 2
        for i in range(10):
            assert (await p.client.recall(f"question {i}")).state == ENABLED
        assert all(p.recalls_served(server) for server in p.servers)


async def test_addresses_are_dialled_as_given_and_names_by_their_addresses() -> None:
    async def resolve(host: str, port: int) -> list[str]:
        if host == "down.internal":
            raise OSError("Name or service not known")
        return {"one.internal": ["127.0.0.1"]}.get(host, [])

    targets = [
        "127.0.0.1:7000",
        "[::1]:7001",
        "one.internal:7002",
        "dns:///x.internal:7003",
        "down.internal:7004",
    ]
    assert await resolve_replicas(targets, resolve) == [
        Replica("127.0.0.1:7000"),
        Replica("[::1]:7001"),
        Replica("ipv4:127.0.0.1:7002", "one.internal:7002"),
        Replica("dns:///x.internal:7003"),
        # Not resolvable now: left to gRPC, which says so when a call is made.
        Replica("down.internal:7004"),
    ]
    # A name that stops resolving for a while keeps the addresses it had.
    had = [Replica("ipv6:[::1]:7004", "down.internal:7004")]
    assert await resolve_replicas(["down.internal:7004"], resolve, had) == had


@dataclasses.dataclass
class Named:
    """Replicas on 127.0.0.1 and ::1 at one port behind ``name``, which resolves to
    ``addresses``, and a client whose watch follows the name."""

    philia: FakePhilia
    port: int
    name: str
    addresses: list[str]
    servers: list[GrpcServer]
    watch: ReplicaWatch
    streams: StreamPool
    client: MemoryClient

    async def start_replica(self, tmp_path: Path, host: str) -> GrpcServer:
        return await _start_replica(self.philia, tmp_path, self.servers, host, self.port)


async def _start_replica(
    philia: FakePhilia, tmp_path: Path, servers: list[GrpcServer], host: str, port: int
) -> GrpcServer:
    """One more replica at ``host``:``port``, added to ``servers``."""
    settings = _settings(philia, tmp_path / f"replica-{len(servers)}", host, port)
    server = await GrpcServer.start(settings)
    servers.append(server)
    return server


@contextlib.asynccontextmanager
async def behind_a_name(tmp_path: Path, per_channel: int, **watch: float) -> AsyncIterator[Named]:
    port = await _free_port(tmp_path)
    name = f"memory.internal:{port}"
    addresses = ["127.0.0.1", "::1"]

    async def resolve(host: str, _port: int) -> list[str]:
        assert host == "memory.internal"
        return list(addresses)

    async with FakePhilia(token=TOKEN) as philia:
        philia.memories = [dict(OOLONG)]
        http = dataclasses.replace(_settings(philia, tmp_path / "http"), grpc_target=name)
        replicas = ReplicaWatch(http, resolve, **watch)
        servers: list[GrpcServer] = []
        try:
            for host in addresses:
                await _start_replica(philia, tmp_path, servers, host, port)
            streams = await replicas.start(per_channel, ())
            client = MemoryClient(
                streams.channels[0],
                recall_budget_s=LONG_BUDGET_S,
                rpc_timeout_s=LONG_BUDGET_S,
                streams=streams,
                replicas=replicas,
            )
            assert await streams.wait_open(LONG_BUDGET_S) == 2 * per_channel
            yield Named(philia, port, name, addresses, servers, replicas, streams, client)
        finally:
            await replicas.aclose()
            for server in servers:
                await server.stop(0)


async def test_replicas_that_move_behind_a_name_are_followed_without_a_restart(
    tmp_path: Path,
) -> None:
    async with behind_a_name(tmp_path, 1, min_gap_s=0) as n:
        first, second = n.servers
        for i in range(4):
            assert (await n.client.recall(f"question {i}")).state == ENABLED
        assert all(_recalls(server) for server in n.servers)

        # A rolling update. First the IPv4 replica leaves the name and stops.
        n.addresses[:] = ["::1"]
        await first.stop(0)
        await n.watch.refresh()
        assert n.watch.replicas == [Replica(f"ipv6:[::1]:{n.port}", n.name)]
        for i in range(3):
            assert (await n.client.recall(f"during the update {i}")).state == ENABLED
        assert _recalls(second)[-3:] == [f"during the update {i}" for i in range(3)]

        # Then a new replica comes up at another address and the last old one goes: no
        # replica the gateway started with is left.
        third = await n.start_replica(tmp_path, "127.0.0.1")
        n.addresses[:] = ["127.0.0.1"]
        last_stream = n.streams.next_open()
        assert last_stream is not None
        await second.stop(0)
        await asyncio.wait_for(last_stream.ended, LONG_BUDGET_S)
        # The next turn finds no stream open, resolves the name again and is answered.
        assert (await n.client.recall("after the update")).state == ENABLED
        assert _recalls(third) == ["after the update"]
        assert n.watch.replicas == [Replica(f"ipv4:127.0.0.1:{n.port}", n.name)]


async def test_status_shows_each_replica_its_open_streams_and_which_one_answered(
    tmp_path: Path,
) -> None:
    """An operator sees the replicas calls are spread over and how many of each one's streams
    are open; and which replica answered, since the breaker and events are that one's."""
    async with behind_a_name(tmp_path, 2) as n:
        ipv4, ipv6 = f"127.0.0.1:{n.port}", f"[::1]:{n.port}"
        status = await n.client.status()
        assert status["replicas"] == [
            {"address": ipv4, "name": n.name, "streams": 2, "streams_open": 2},
            {"address": ipv6, "name": n.name, "streams": 2, "streams_open": 2},
        ]
        assert status["answered_by"] in (ipv4, ipv6)

        # The IPv4 replica stops (its name still lists it): once its two streams have
        # ended, the status shows none of them open and comes from the other replica.
        every_stream = {n.streams.next_open() for _ in range(4)}
        pending = {stream.ended for stream in every_stream if stream is not None}
        assert len(pending) == 4
        await n.servers[0].stop(0)
        ended = 0
        while ended < 2:
            done, pending = await asyncio.wait(
                pending, timeout=LONG_BUDGET_S, return_when=asyncio.FIRST_COMPLETED
            )
            assert done, "the stopped replica's streams did not end"
            ended += len(done)
        status = await n.client.status()
        assert [(r["address"], r["streams_open"]) for r in status["replicas"]] == [
            (ipv4, 0),
            (ipv6, 2),
        ]
        assert status["answered_by"] == ipv6


async def test_no_replica_up_fails_a_call_at_once(tmp_path: Path) -> None:
    async with pool_of(tmp_path) as p:
        await p.servers[0].stop(0)
        started = time.monotonic()
        for _ in range(3):
            assert (await p.client.recall("anyone there?")).state == OFFLINE
        assert time.monotonic() - started < LONG_BUDGET_S / 2


async def test_a_replica_that_stops_answers_its_calls_and_the_next_ones_move(
    tmp_path: Path,
) -> None:
    async with pool_of(tmp_path, replicas=2) as p:
        assert await p.streams.wait_open(LONG_BUDGET_S) == 2
        release = asyncio.Event()
        p.philia.script(QUERY, Step(hold=release), Step(hold=release))
        held = [asyncio.create_task(p.client.recall(f"held question {i}")) for i in range(2)]
        await p.philia.wait_frames(QUERY, 2)

        stopping, staying = p.servers
        started = time.monotonic()
        stop = asyncio.create_task(stopping.stop(grace=LONG_BUDGET_S))
        # Meanwhile every call is answered: none goes offline.
        for i in range(4):
            assert (await p.client.recall(f"new question {i}")).state == ENABLED
        # The calls it already had are answered, not dropped.
        release.set()
        assert [o.state for o in await asyncio.gather(*held)] == [ENABLED, ENABLED]
        # It stops as soon as they are, not at the end of its grace period.
        await stop
        assert time.monotonic() - started < LONG_BUDGET_S / 2
        # From then on the other replica takes every call.
        for i in range(4):
            assert (await p.client.recall(f"later question {i}")).state == ENABLED
        assert p.recalls_served(staying)[-4:] == [f"later question {i}" for i in range(4)]


async def test_a_stream_retired_while_a_writeback_lingers_sends_it_then_ends(
    tmp_path: Path,
) -> None:
    async with pool_of(tmp_path) as p:
        stream = await p.streams.stream(LONG_BUDGET_S)
        call_id, call = stream.start(LONG_BUDGET_S, linger=True)
        call.writeback.user = "I like oolong"
        call.writeback.assistant = "Noted."
        # Retired (as on a goodbye) while the writeback waits for company: it goes out now,
        # and this side of the stream closes after it, so the stream ends once it is answered.
        stream.retire()
        reply = await stream.reply(call_id, LONG_BUDGET_S)
        assert reply.writeback.stored
        await asyncio.wait_for(asyncio.shield(stream.ended), LONG_BUDGET_S / 2)
        [stored] = await p.philia.wait_frames(STORE)
        assert stored["params"]["text"] == "User: I like oolong\nAssistant: Noted."


class _OlderServicer(MemoryServicer):
    """A MemoryService of a version without ``Exchange``."""

    async def Exchange(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.ExchangeRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


async def test_a_replica_without_exchange_gets_unary_calls(tmp_path: Path) -> None:
    async with FakePhilia(token=TOKEN) as philia:
        philia.memories = [dict(OOLONG)]
        domain = MemoryDomain(_settings(philia, tmp_path / "older"))
        server = build_server(domain, servicer=_OlderServicer(domain))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = open_memory_channel(
            _settings(philia, tmp_path / "http"), Replica(f"127.0.0.1:{port}")
        )
        streams = StreamPool([channel], 2)
        client = MemoryClient(
            channel, recall_budget_s=LONG_BUDGET_S, rpc_timeout_s=LONG_BUDGET_S, streams=streams
        )
        try:
            # The first recall finds out and still gets its memories, as every later call does.
            for i in range(3):
                recalled = await client.recall(f"question {i}")
                assert (recalled.state, recalled.section.count("oolong")) == (ENABLED, 1)
            assert streams.unimplemented
            assert await client.writeback("I like oolong", "Noted.")
            [stored] = await philia.wait_frames(STORE)
            assert stored["params"]["text"] == "User: I like oolong\nAssistant: Noted."
        finally:
            streams.close()
            await channel.close(grace=None)
            await server.stop(0)
            await domain.aclose()
