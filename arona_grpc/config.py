"""Settings: read once from the environment at start-up and passed down.

Every knob of the gateway lives in the one frozen :class:`Settings` object;
nothing else reads ``os.environ``. Invalid configuration that would leave the
server useless (a bad port, a short JWT secret) raises :class:`ConfigError`
with one line meant for the operator; a malformed optional value logs a
warning naming the variable and keeps the default.

``ARONA_MEMORY_URL`` is one URL, or several (comma-separated) of store processes serving the
same memories (:attr:`Settings.memory_urls`; arona_grpc.stores spreads the calls over them).

Memory-path robustness knobs: ``ARONA_MEMORY_BREAKER_FAILURES`` (consecutive
Philia failures that open the breaker, default 3), ``ARONA_MEMORY_BREAKER_COOLDOWN_S``
(how long it stays open before one probe, default 5), ``ARONA_MEMORY_RECALL_BUDGET_MS``
(how long a turn waits for recall, default the RPC timeout) and
``ARONA_MEMORY_OUTBOX_MAX_MB`` (what the episodes kept in ``<ARONA_DATA_DIR>/outbox.db``
while Philia is down may take, default 256 MB; beyond it the oldest are dropped and counted).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from arona_grpc.redact import url_password

logger = logging.getLogger(__name__)

MIN_JWT_SECRET_BYTES = 32
SCOPE_SHARED = "shared"
SCOPE_USER = "user"
SCOPE_MODES = (SCOPE_SHARED, SCOPE_USER)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# What goes to Philia, per episode side and per recall question (arona_grpc.sizes says why
# these fit Philia's frame budget whatever the text).
DEFAULT_EPISODE_CHARS = 32_000
DEFAULT_QUERY_CHARS = 4_000
# The HTTP edge (gateway_http.edge): a request's head and body, a WebSocket message, and how
# long each may take to arrive.
DEFAULT_MAX_BODY_BYTES = 1 << 20
# An upload's body (/v1/audio/transcriptions, /v1/audio/translations): OpenAI takes files of up
# to 25 MB, and the form's other fields come on top.
DEFAULT_MAX_UPLOAD_BYTES = 26 << 20
DEFAULT_MAX_HEADER_BYTES = 32 * 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
# Longer than the idle time of the clients and proxies in front (the OpenAI SDK's pool keeps
# connections 5 s, load balancers commonly 60 s): the side that closes first must be the
# client, or a request sent as the gateway closes the connection fails.
DEFAULT_KEEPALIVE_S = 65.0
# JSON-RPC: the calls one batch may hold.
DEFAULT_RPC_MAX_BATCH = 50
# memory.status: the characters an event's detail keeps (a recall's question, an error).
DEFAULT_STATUS_DETAIL_CHARS = 300
MB = 2**20
DEFAULT_OUTBOX_MAX_MB = 256
DEFAULT_USAGE_REFRESH_S = 2.0


class ConfigError(ValueError):
    """Configuration that would leave the server useless; the message is one line."""


@dataclass(frozen=True)
class Settings:
    memory_url: str | None = None
    memory_token: str | None = field(default=None, repr=False)
    memory_writeback: bool = True
    # A streamed REST turn without a conversation_id is written back too (the seed writes back
    # a streamed turn only with a conversation); read by the HTTP layer.
    memory_stream_writeback: bool = False
    memory_timeout_s: float = 10.0
    memory_breaker_failures: int = 3
    memory_breaker_cooldown_s: float = 5.0
    # None = the RPC timeout.
    memory_recall_budget_ms: int | None = None
    # What the episodes kept for replay while Philia is down may take, in bytes
    # (ARONA_MEMORY_OUTBOX_MAX_MB); the oldest are dropped beyond it.
    memory_outbox_max_bytes: int = DEFAULT_OUTBOX_MAX_MB * MB
    # Characters of each side of an episode, and of a recall question, sent to Philia
    # (arona_grpc.sizes: a longer side is shortened with a marker, a longer question
    # recalled by its last part).
    memory_max_episode_chars: int = DEFAULT_EPISODE_CHARS
    memory_max_query_chars: int = DEFAULT_QUERY_CHARS
    # "shared": one memory pool (the default); "user": each caller's own scope only.
    memory_scope: str = SCOPE_SHARED
    upstream_url: str | None = None
    upstream_api_key: str | None = field(default=None, repr=False)
    # The backends file (ARONA_BACKENDS): named upstreams and the models each serves, read and
    # checked by the HTTP layer's entry point; None = the one upstream_url (or echo).
    backends_file: Path | None = None
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051
    # None = the local gRPC listener; several replicas: a comma-separated list.
    grpc_target: str | None = None
    # Exchange streams the HTTP layer keeps to each gRPC replica for recall and writeback
    # (0: a unary call each).
    grpc_streams: int = 2
    # Every MemoryService call must carry `authorization: Bearer <token>` (None = open).
    grpc_token: str | None = field(default=None, repr=False)
    # PEM files: the service's certificate and key (TLS listener), the CA the HTTP layer trusts.
    grpc_tls_cert: Path | None = None
    grpc_tls_key: Path | None = None
    grpc_tls_ca: Path | None = None
    jwt_secret: str | None = field(default=None, repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    data_dir: Path = Path(".arona")
    log_level: str = "info"
    # "text" or "json" (one JSON object per line).
    log_format: str = "text"
    # Prometheus metrics: recorded and exposed at /metrics (false: neither).
    metrics: bool = True
    # When set, /metrics on the HTTP listener asks for `Authorization: Bearer <token>`.
    metrics_token: str | None = field(default=None, repr=False)
    # The gRPC service's own metrics listener (None: off).
    grpc_metrics_port: int | None = None
    # postgresql://…: conversations, the episode index and the outbox shared by every replica;
    # None = SQLite files under data_dir.
    database_url: str | None = field(default=None, repr=False)
    # How long a replica's claim on an outbox episode (PostgreSQL) holds before another
    # replica may replay it.
    memory_outbox_claim_s: float = 30.0
    # The HTTP layer journals each episode before answering (durable before answered).
    writeback_journal: bool = True
    # The HTTP edge (gateway_http.edge): request body and WebSocket message, header block,
    # how long a request's head and its body may take to arrive, and how long an idle
    # connection is kept.
    http_max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    http_max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    http_max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    http_header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    http_body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    http_keepalive_s: float = DEFAULT_KEEPALIVE_S
    # JSON-RPC calls in one batch; a longer batch is refused whole (-32600).
    rpc_max_batch: int = DEFAULT_RPC_MAX_BATCH
    # Characters of a memory.status event's detail; a longer one is shortened.
    memory_status_detail_chars: int = DEFAULT_STATUS_DETAIL_CHARS
    # Usage metering (ARONA_USAGE): every answered turn recorded, monthly budgets enforced.
    usage: bool = True
    # How stale the budgets and the other replicas' spending a budget check sees may be
    # (ARONA_USAGE_REFRESH_S); 0: read from the database on every budgeted turn.
    usage_refresh_s: float = DEFAULT_USAGE_REFRESH_S

    @property
    def memory_urls(self) -> tuple[str, ...]:
        """The stores ``ARONA_MEMORY_URL`` names (comma-separated), in order, each once: one
        Philia, or several store processes serving the same memories (arona_grpc.stores)."""
        return _url_list(self.memory_url)

    @property
    def memory_enabled(self) -> bool:
        """The gateway talks to Philia iff both the URL and the token are non-empty."""
        return bool(self.memory_urls) and bool(self.memory_token)

    @property
    def user_scoped(self) -> bool:
        """Whether memory belongs to each user (``ARONA_MEMORY_SCOPE=user``)."""
        return self.memory_scope == SCOPE_USER

    @property
    def recall_budget_s(self) -> float:
        """How long a chat turn waits for recall before it goes on ``offline``."""
        if self.memory_recall_budget_ms is None:
            return self.memory_timeout_s
        return self.memory_recall_budget_ms / 1000.0

    @property
    def effective_grpc_target(self) -> str:
        """Where the HTTP layer finds ``MemoryService``."""
        if self.grpc_target:
            return self.grpc_target
        host = self.grpc_host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.grpc_port}"

    @property
    def grpc_targets(self) -> tuple[str, ...]:
        """The gRPC replicas the HTTP layer spreads its calls over, one target each."""
        parts = (part.strip() for part in self.effective_grpc_target.split(","))
        return tuple(part for part in parts if part)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Build settings from an environment mapping (normally ``os.environ``)."""
        backends_file = _path(env, "ARONA_BACKENDS")
        if backends_file is not None and _str(env, "ARONA_UPSTREAM_URL") is not None:
            raise ConfigError(
                "ARONA_BACKENDS and ARONA_UPSTREAM_URL are both set: the backends file names "
                "every upstream, so unset ARONA_UPSTREAM_URL (and ARONA_UPSTREAM_API_KEY)"
            )
        return cls(
            memory_url=_memory_url(env),
            memory_token=_str(env, "ARONA_MEMORY_TOKEN"),
            memory_writeback=_strict_bool(env, "ARONA_MEMORY_WRITEBACK", True),
            memory_stream_writeback=_strict_bool(env, "ARONA_MEMORY_STREAM_WRITEBACK", False),
            memory_timeout_s=_positive_float(env, "ARONA_MEMORY_TIMEOUT_S", 10.0),
            memory_breaker_failures=_positive_int(env, "ARONA_MEMORY_BREAKER_FAILURES", 3),
            memory_breaker_cooldown_s=_positive_float(env, "ARONA_MEMORY_BREAKER_COOLDOWN_S", 5.0),
            memory_recall_budget_ms=_optional_positive_int(env, "ARONA_MEMORY_RECALL_BUDGET_MS"),
            memory_outbox_max_bytes=_outbox_max_bytes(env),
            memory_max_episode_chars=_positive_int(
                env, "ARONA_MEMORY_MAX_EPISODE_CHARS", DEFAULT_EPISODE_CHARS
            ),
            memory_max_query_chars=_positive_int(
                env, "ARONA_MEMORY_MAX_QUERY_CHARS", DEFAULT_QUERY_CHARS
            ),
            memory_scope=_memory_scope(env),
            upstream_url=_str(env, "ARONA_UPSTREAM_URL"),
            upstream_api_key=_str(env, "ARONA_UPSTREAM_API_KEY"),
            backends_file=backends_file,
            http_host=_str(env, "ARONA_HTTP_HOST") or "127.0.0.1",
            http_port=_port(env, "ARONA_HTTP_PORT", 8080),
            grpc_host=_str(env, "ARONA_GRPC_HOST") or "127.0.0.1",
            grpc_port=_port(env, "ARONA_GRPC_PORT", 50051),
            grpc_target=_str(env, "ARONA_GRPC_TARGET"),
            grpc_streams=_streams(env),
            grpc_token=_str(env, "ARONA_GRPC_TOKEN"),
            grpc_tls_cert=_path(env, "ARONA_GRPC_TLS_CERT"),
            grpc_tls_key=_path(env, "ARONA_GRPC_TLS_KEY"),
            grpc_tls_ca=_path(env, "ARONA_GRPC_TLS_CA"),
            jwt_secret=_jwt_secret(env),
            api_keys=_api_keys(env),
            data_dir=Path(_str(env, "ARONA_DATA_DIR") or ".arona"),
            log_level=_log_level(env),
            log_format=_log_format(env),
            metrics=_strict_bool(env, "ARONA_METRICS", True),
            metrics_token=_str(env, "ARONA_METRICS_TOKEN"),
            grpc_metrics_port=(
                _port(env, "ARONA_GRPC_METRICS_PORT", 0)
                if _str(env, "ARONA_GRPC_METRICS_PORT") is not None
                else None
            ),
            database_url=_database_url(env),
            memory_outbox_claim_s=_positive_float(env, "ARONA_MEMORY_OUTBOX_CLAIM_S", 30.0),
            writeback_journal=_strict_bool(env, "ARONA_WRITEBACK_JOURNAL", True),
            http_max_body_bytes=_positive_int(
                env, "ARONA_HTTP_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES
            ),
            http_max_upload_bytes=_positive_int(
                env, "ARONA_HTTP_MAX_UPLOAD_BYTES", DEFAULT_MAX_UPLOAD_BYTES
            ),
            http_max_header_bytes=_positive_int(
                env, "ARONA_HTTP_MAX_HEADER_BYTES", DEFAULT_MAX_HEADER_BYTES
            ),
            http_header_timeout_s=_positive_float(
                env, "ARONA_HTTP_HEADER_TIMEOUT_S", DEFAULT_HEADER_TIMEOUT_S
            ),
            http_body_timeout_s=_positive_float(
                env, "ARONA_HTTP_BODY_TIMEOUT_S", DEFAULT_BODY_TIMEOUT_S
            ),
            http_keepalive_s=_positive_float(env, "ARONA_HTTP_KEEPALIVE_S", DEFAULT_KEEPALIVE_S),
            rpc_max_batch=_positive_int(env, "ARONA_RPC_MAX_BATCH", DEFAULT_RPC_MAX_BATCH),
            memory_status_detail_chars=_positive_int(
                env, "ARONA_MEMORY_STATUS_DETAIL_CHARS", DEFAULT_STATUS_DETAIL_CHARS
            ),
            usage=_strict_bool(env, "ARONA_USAGE", True),
            usage_refresh_s=_positive_float(
                env, "ARONA_USAGE_REFRESH_S", DEFAULT_USAGE_REFRESH_S, zero=True
            ),
        )

    @property
    def secret_values(self) -> tuple[str, ...]:
        """Every configured secret, for the log formatters' backstop."""
        values = (
            self.memory_token,
            self.jwt_secret,
            self.upstream_api_key,
            self.metrics_token,
            self.grpc_token,
            self.database_url,
            url_password(self.database_url),
            # A named entry's key (`name=key`) and the entry as written.
            *(entry.partition("=")[2] for entry in self.api_keys),
            *self.api_keys,
        )
        return tuple(v for v in values if v)


def _str(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def _url_list(value: str | None) -> tuple[str, ...]:
    parts = (part.strip() for part in (value or "").split(","))
    return tuple(dict.fromkeys(part for part in parts if part))


def _memory_url(env: Mapping[str, str]) -> str | None:
    value = _str(env, "ARONA_MEMORY_URL")
    if value is not None:
        named = [part for part in (p.strip() for p in value.split(",")) if part]
        if len(named) != len(set(named)):
            # Not echoed: a URL may carry the token.
            logger.warning("ARONA_MEMORY_URL names a store more than once; each is used once")
    return value


def _path(env: Mapping[str, str], name: str) -> Path | None:
    value = _str(env, name)
    return Path(value) if value else None


def _strict_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    if name not in env:
        return default
    value = env[name]
    if value == "true":
        return True
    if value == "false":
        return False
    # The value itself is not echoed: it is not a secret here, but nothing
    # read from the environment is printed back.
    logger.warning(
        "%s must be exactly 'true' or 'false'; keeping the default (%s)",
        name,
        "true" if default else "false",
    )
    return default


def _positive_float(
    env: Mapping[str, str], name: str, default: float, *, zero: bool = False
) -> float:
    """Seconds: a positive number (or 0 too, with ``zero``)."""
    raw = _str(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero else value > 0) or value == float("inf"):
        allowed = "0 or a positive number" if zero else "a positive number"
        raise ConfigError(f"{name} must be {allowed} of seconds, got {raw!r}")
    return value


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = _optional_positive_int(env, name)
    return default if value is None else value


def _optional_positive_int(env: Mapping[str, str], name: str) -> int | None:
    raw = _str(env, name)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) <= 0:
        raise ConfigError(f"{name} must be a positive whole number, got {raw!r}")
    return int(raw)


# More streams per replica buy nothing: one stream carries thousands of calls a second.
MAX_GRPC_STREAMS = 64


def _streams(env: Mapping[str, str]) -> int:
    raw = _str(env, "ARONA_GRPC_STREAMS")
    if raw is None:
        return 2
    if not raw.isdigit() or int(raw) > MAX_GRPC_STREAMS:
        raise ConfigError(
            f"ARONA_GRPC_STREAMS must be a whole number from 0 (unary calls) to "
            f"{MAX_GRPC_STREAMS}, got {raw!r}"
        )
    return int(raw)


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    raw = _str(env, name)
    if raw is None:
        return default
    # 0 asks the OS for a free port (used by tests and `up` on busy machines).
    if not raw.isdigit() or int(raw) > 65535:
        raise ConfigError(f"{name} must be a port number from 0 to 65535, got {raw!r}")
    return int(raw)


def _jwt_secret(env: Mapping[str, str]) -> str | None:
    secret = env.get("ARONA_JWT_SECRET", "")
    if not secret:
        return None
    if len(secret.encode()) < MIN_JWT_SECRET_BYTES:
        raise ConfigError(
            f"ARONA_JWT_SECRET must be at least {MIN_JWT_SECRET_BYTES} bytes for HS256"
        )
    return secret


def _api_keys(env: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(k.strip() for k in env.get("ARONA_API_KEYS", "").split(",") if k.strip())


def _database_url(env: Mapping[str, str]) -> str | None:
    url = _str(env, "ARONA_DATABASE_URL")
    if url is None:
        return None
    if not url.startswith(("postgresql://", "postgres://")):
        # The value may hold a password: it is not echoed.
        raise ConfigError("ARONA_DATABASE_URL must be a postgresql:// URL")
    return url


def _memory_scope(env: Mapping[str, str]) -> str:
    raw = _str(env, "ARONA_MEMORY_SCOPE") or SCOPE_SHARED
    if raw not in SCOPE_MODES:
        raise ConfigError(f"ARONA_MEMORY_SCOPE must be 'shared' or 'user', got {raw!r}")
    return raw


def _outbox_max_bytes(env: Mapping[str, str]) -> int:
    if _str(env, "ARONA_MEMORY_OUTBOX_MAX") is not None:
        logger.warning(
            "ARONA_MEMORY_OUTBOX_MAX is no longer used: the outbox is bounded by the bytes its "
            "episodes take, ARONA_MEMORY_OUTBOX_MAX_MB (default %d)",
            DEFAULT_OUTBOX_MAX_MB,
        )
    return _positive_int(env, "ARONA_MEMORY_OUTBOX_MAX_MB", DEFAULT_OUTBOX_MAX_MB) * MB


def _log_format(env: Mapping[str, str]) -> str:
    raw = (_str(env, "ARONA_LOG_FORMAT") or "text").lower()
    if raw not in ("text", "json"):
        raise ConfigError(f"ARONA_LOG_FORMAT must be 'text' or 'json', got {raw!r}")
    return raw


def _log_level(env: Mapping[str, str]) -> str:
    raw = (_str(env, "ARONA_LOG_LEVEL") or "info").lower()
    if raw not in LOG_LEVELS:
        raise ConfigError(f"ARONA_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {raw!r}")
    return raw
