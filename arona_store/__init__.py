"""The embedded Philia-compatible memory store: a WebSocket JSON-RPC server over SQLite FTS5."""
