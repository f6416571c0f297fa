"""HTTP routes: REST (OpenAI-compatible) and JSON-RPC."""
