"""The gRPC ``MemoryService`` (``arona.memory.v1``) and what it stands on: its domain
(:mod:`arona_grpc.service`: recall, writeback and the outbox's replay, deletion and erasure,
listing, status), the Philia WebSocket JSON-RPC client or a pool over several stores
(:mod:`arona_grpc.philia`, :mod:`arona_grpc.stores`), the writeback outbox and the episode index
(SQLite or PostgreSQL), the settings every process reads (:mod:`arona_grpc.config`), and the
service's security, metrics and logs."""
