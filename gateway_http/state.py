"""What one running gateway holds: built in the app's lifespan, reached by routes."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from arona_grpc.config import Settings
from gateway_http.auth import RestAuth
from gateway_http.conversations import ConversationStore
from gateway_http.jsonrpc import Dispatcher
from gateway_http.memory_client import MemoryClient
from gateway_http.turns import TurnPipeline
from gateway_http.upstream.routing import Router
from gateway_http.usage.metering import Metering


@dataclass
class Gateway:
    settings: Settings
    memory: MemoryClient
    router: Router
    conversations: ConversationStore
    pipeline: TurnPipeline
    rest_auth: RestAuth
    dispatcher: Dispatcher
    # Usage metering and budgets (None: ARONA_USAGE=false).
    usage: Metering | None = None


def gateway_of(conn: HTTPConnection) -> Gateway:
    gateway: Gateway = conn.app.state.gateway
    return gateway
