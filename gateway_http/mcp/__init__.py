"""Memory for agents over the Model Context Protocol: the tools (:mod:`.tools`), the server
that runs them for a caller (:mod:`.server`), ``/mcp`` over Streamable HTTP (:mod:`.endpoint`,
its direct path for a lone tool call in :mod:`.direct`) and ``arona-gateway mcp``, the stdio
bridge to a gateway's ``/mcp`` (:mod:`.bridge`; its command in :mod:`gateway_http.commands.mcp`)."""
