"""The HTTP layer's channel finds a connection to the gRPC service that went dead silently.

Between the two runs a TCP relay on ``127.0.0.1`` that can "freeze" the connections it carries:
they stay open but nothing gets through any more, the way a NAT or firewall forgets an idle
flow. New connections are relayed as before. The keepalive times are shortened for the test;
the server runs with its real options.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from arona_grpc.config import Settings
from arona_grpc.server import GrpcServer
from gateway_http.grpc_channel import channel_options
from gateway_http.memory_client import MemoryClient

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

# Each wait below covers two to four keepalive periods, 3 to 4 s in all (gRPC's own timers,
# so about as long on a loaded box): ten times that before giving up.
WAIT_S = 40.0


# An HTTP/2 PING frame with the ACK flag: length 8, type 6, flags 1, stream 0.
PING_ACK = b"\x00\x00\x08\x06\x01\x00\x00\x00\x00"


class FreezingRelay:
    """Relays TCP to ``target``; :meth:`freeze` silences every connection open at the time."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.connections = 0
        self.ping_acks = 0  # answers to the client's pings that got through
        self._acked = asyncio.Condition()
        self._generation = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[FreezingRelay]:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        try:
            async with server:
                yield self
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def freeze(self) -> None:
        self._generation += 1

    async def wait_ping_acks(self, count: int) -> None:
        """Wait until ``count`` more of the client's pings have been answered."""
        async with self._acked:
            target = self.ping_acks + count
            await asyncio.wait_for(self._acked.wait_for(lambda: self.ping_acks >= target), WAIT_S)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        generation = self._generation
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, generation)),
            asyncio.create_task(self._pump(up_reader, writer, generation, to_client=True)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        for w in (writer, up_writer):
            w.close()

    async def _pump(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        generation: int,
        *,
        to_client: bool = False,
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                if generation != self._generation:
                    continue  # frozen: everything is swallowed
                sink.write(data)
                await sink.drain()
                if to_client and PING_ACK in data:
                    async with self._acked:
                        self.ping_acks += data.count(PING_ACK)
                        self._acked.notify_all()


@pytest_asyncio.fixture
async def relay() -> AsyncIterator[FreezingRelay]:
    server = await GrpcServer.start(Settings(grpc_port=0))
    try:
        async with FreezingRelay(server.port).serve() as running:
            yield running
    finally:
        await server.stop(0)


async def test_a_silently_dropped_connection_is_replaced_before_the_next_call(
    relay: FreezingRelay,
) -> None:
    options = channel_options(keepalive_time_ms=1_500, keepalive_timeout_ms=1_000)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{relay.port}", options=options) as channel:
        client = MemoryClient(channel, recall_budget_s=1.0, rpc_timeout_s=1.0)
        assert (await client.status())["enabled"] is False
        # Idle, with every ping answered so far (a ping still on its way when the link
        # dies is another case: gRPC then waits for that one).
        await relay.wait_ping_acks(2)
        assert channel.get_state() is grpc.ChannelConnectivity.READY

        relay.freeze()
        # No call is made: the next keepalive ping goes unanswered and the channel drops
        # the dead connection on its own.
        await asyncio.wait_for(
            channel.wait_for_state_change(grpc.ChannelConnectivity.READY), WAIT_S
        )
        # The next call gets a fresh connection and answers at once.
        assert (await client.status())["enabled"] is False
        assert relay.connections == 2


async def test_the_service_accepts_the_pings_of_an_idle_channel(relay: FreezingRelay) -> None:
    # gRPC's default server would answer a ping without calls (or closer than 5 minutes to
    # the last) with GOAWAY and close the connection; ours keeps it.
    options = channel_options(keepalive_time_ms=1_200, keepalive_timeout_ms=1_000)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{relay.port}", options=options) as channel:
        client = MemoryClient(channel, recall_budget_s=1.0, rpc_timeout_s=1.0)
        await client.status()
        # Three pings answered while idle, and the connection is the same one.
        await relay.wait_ping_acks(4)
        assert channel.get_state() is grpc.ChannelConnectivity.READY
        await client.status()
        assert relay.connections == 1
