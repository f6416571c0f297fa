"""Which backend answers a turn."""

from __future__ import annotations

from gateway_http.upstream.backend import ChatBackend
from gateway_http.upstream.client import OpenAIUpstream
from gateway_http.upstream.echo import EchoModel


def build_backend(upstream_url: str | None, api_key: str | None) -> ChatBackend:
    """The upstream when ``upstream_url`` is set, otherwise the ``echo`` model."""
    if upstream_url:
        return OpenAIUpstream(upstream_url, api_key)
    return EchoModel()
