"""The ground floor every layer stands on, importing none of them: database errors and schema
migrations (:mod:`~arona_common.database`), redaction of secrets in URLs and texts
(:mod:`~arona_common.redact`), storage faults said once (:mod:`~arona_common.storage`), and the
OpenTelemetry set-up (:mod:`~arona_common.tracing`). The gateway's HTTP layer, the gRPC memory
service and the memory store each import from here, so the store, a server of its own, depends on
nothing above it."""
