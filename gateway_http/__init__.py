"""The thin FastAPI layer: REST, SSE and JSON-RPC chat surfaces over the gRPC MemoryService."""
