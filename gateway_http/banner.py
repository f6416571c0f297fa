"""What ``arona-gateway up`` prints once it serves: its addresses, a JWT, and command lines that
work as printed in the mode it started in (chat, status, grpcurl, and the forget of what the
chat line stored), for its own ports and data directory.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from arona_common.redact import redact_url
from arona_grpc.config import Settings

if TYPE_CHECKING:
    from gateway_http.upstream.backends_file import BackendsFile


class Serving(Protocol):
    """The addresses of the parts that came up (``gateway_http.commands.serving.Running``)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def http_url(self) -> str | None: ...

    @property
    def grpc_target(self) -> str | None: ...


# The banner's JWT: its subject and lifetime.
UP_SUBJECT = "dev"
UP_TOKEN_TTL_S = 24 * 3600

_SCOPE_WORDS = {
    "shared": "one memory pool for every caller",
    "user": "each caller recalls only their own memories",
}


def banner(
    running: Serving,
    jwt_secret: str,
    upstream_echo: bool,
    store_url: str | None,
    backends: BackendsFile | None = None,
    store_database_url: str | None = None,
) -> str:
    """What ``up`` prints once it serves: its addresses, a JWT, and hints that work as
    printed in the mode it started in (run them from the directory ``up`` was started in)."""
    from gateway_http.auth import mint_token

    settings = running.settings
    # In user mode memory.status (and the console) are an admin's: the dev token is one, so
    # everything the banner offers works with it.
    admin = settings.user_scoped
    token = mint_token(jwt_secret, UP_SUBJECT, UP_TOKEN_TTL_S, admin=admin)
    http = running.http_url or ""
    grpc_target = running.grpc_target or ""
    # The chat hint asks for a model that is routed: echo, or the backends file's first one.
    model = (backends.example_model() if backends is not None else None) or "echo"
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "I prefer oolong tea"}]}
    )
    status = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "memory.status"})
    bearer = '-H "Authorization: Bearer $JWT" '
    # A turn needs a caller when REST takes keys (else 401) or memory is per user (else a
    # turn of nobody, which recalls and stores nothing); the JWT is one on REST as well.
    chat_bearer = bearer if settings.user_scoped or settings.api_keys else ""
    scope = settings.memory_scope
    lines = [
        "Arona Memory Gateway is up.",
        f"  HTTP     {http}  (REST /v1, JSON-RPC {http}/api/rpc)",
        f"  console  {http}/console  (sign in with the JWT below)",
        f"  gRPC     {grpc_target}  (arona.memory.v1.MemoryService)",
    ]
    if settings.metrics:
        lines.append(f"  metrics  {http}/metrics  (Prometheus; ARONA_METRICS)")
    lines += [
        f"  scope    {scope}  ({_SCOPE_WORDS[scope]}; ARONA_MEMORY_SCOPE)",
    ]
    if store_url is not None:
        lines.append(f"  memory   {store_url}  ({_store_words(store_database_url)})")
    else:
        shown = ", ".join(redact_url(url) for url in settings.memory_urls)
        lines.append(f"  memory   {shown}")
    if backends is not None:
        names = ", ".join(spec.name for spec in backends.backends)
        lines.append(f"  models   routed to {names}  ({backends.path}; ARONA_BACKENDS)")
    elif upstream_echo:
        lines.append("  model    echo  (development default: replies show the recalled memories)")
    role = ", admin" if admin else ""
    lines += [
        "",
        f"JWT for JSON-RPC (sub={UP_SUBJECT}{role}, valid 24 h): {token}",
        "",
        "Try it (in this directory; the first line puts the JWT in $JWT):",
        f"  JWT={token}",
        f"  curl -si {http}/v1/chat/completions {chat_bearer}"
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)}",
        f"  curl -s {http}/api/rpc {bearer}-d {shlex.quote(status)}",
        f"  {beside_python('grpcurl')} {_grpcurl_flags(settings)}{grpc_target} "
        "arona.memory.v1.MemoryService/Status",
        "",
        *_forget_hint(settings, grpc_target, anonymous=not chat_bearer),
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def _store_words(database_url: str | None) -> str:
    """What the embedded store keeps its memories in, as the banner names it."""
    if database_url is None:
        return "embedded Philia-compatible store, memories in SQLite"
    return f"embedded Philia-compatible store, memories in PostgreSQL {redact_url(database_url)}"


def _forget_hint(settings: Settings, grpc_target: str, *, anonymous: bool) -> list[str]:
    """The forget command for what the banner's chat line stores, for this gateway's gRPC
    address and data directory (the command's defaults may be another gateway's)."""
    assignments = [f"ARONA_GRPC_TARGET={shlex.quote(grpc_target)}"]
    if settings.data_dir != Path(".arona"):
        assignments.append(f"ARONA_DATA_DIR={shlex.quote(str(settings.data_dir))}")
    if settings.grpc_tls_ca is not None:
        assignments.append(f"ARONA_GRPC_TLS_CA={shlex.quote(str(settings.grpc_tls_ca))}")
    command = " ".join([*assignments, beside_python("arona-gateway"), "forget"])
    if anonymous:
        return [
            "Forget what the chat line stored (turns without a bearer belong to no principal; "
            'JSON-RPC: memory.forget {"anonymous": true}):',
            f"  {command} --anonymous",
        ]
    return [
        f"Forget what the chat line stored (the turns and conversations of sub={UP_SUBJECT}; "
        "JSON-RPC: memory.forget {}):",
        f"  {command} --principal {UP_SUBJECT}",
    ]


def beside_python(name: str) -> str:
    """How to run the command ``name`` installed beside this Python (``make`` installs
    grpcurl into ``.venv/bin``, which is not on the PATH): a path relative to the current
    directory when it is below it, else absolute; plain ``name`` when it is not there."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        return name
    try:
        relative = path.absolute().relative_to(Path.cwd())
    except ValueError:
        return shlex.quote(str(path.absolute()))
    return shlex.quote(str(relative) if len(relative.parts) > 1 else f"./{relative}")


def _grpcurl_flags(settings: Settings) -> str:
    """grpcurl's flags for the listener: TLS or not, and the token (by name, never its value)."""
    flags = ""
    if settings.grpc_tls_ca is not None:
        flags += f"-cacert {shlex.quote(str(settings.grpc_tls_ca))} "
    elif settings.grpc_tls_cert is None:
        flags += "-plaintext "
    if settings.grpc_token:
        flags += '-H "authorization: Bearer $ARONA_GRPC_TOKEN" '
    return flags
