"""The HTTP layer, reaching memory only through the gRPC ``MemoryService``: the one chat-turn
pipeline (:mod:`~gateway_http.turns`) behind the OpenAI-compatible REST surface (chat completions
as JSON and SSE, the Responses API in :mod:`~gateway_http.responses`, every other OpenAI route
passed through to its backend), JSON-RPC and its operator console, the memory tools over MCP
(:mod:`~gateway_http.mcp`), the upstreams and their routing (:mod:`~gateway_http.upstream`), usage
and budgets (:mod:`~gateway_http.usage`), importing history, and the ``arona-gateway`` command
line (:mod:`~gateway_http.commands`)."""
