"""The gRPC ``MemoryService`` and the Philia WebSocket JSON-RPC client it wraps."""
