"""``token``: a JWT for the JSON-RPC surface (and the console), minted with ``ARONA_JWT_SECRET`` or
the dev secret of ``up``.
"""

from __future__ import annotations

import logging
from collections.abc import (
    Mapping,
)
from typing import TYPE_CHECKING, Any

from arona_grpc.config import Settings

if TYPE_CHECKING:
    pass
from gateway_http.commands.runtime import DEV_SECRETS_FILE, StartupError, load_dev_secrets

logger = logging.getLogger("arona_gateway")


def mint(env: Mapping[str, str], sub: str, ttl: int, admin: bool = False) -> str:
    from gateway_http.auth import mint_token

    settings = Settings.from_env(env)
    secret = settings.jwt_secret
    if secret is None:
        dev = settings.data_dir / DEV_SECRETS_FILE
        if not dev.exists():
            raise StartupError("ARONA_JWT_SECRET is not set (and no dev secret exists yet)")
        secret = load_dev_secrets(settings.data_dir)["jwt_secret"]
    return mint_token(secret, sub, ttl, admin=admin)


def add_token_parser(sub: Any) -> None:
    token = sub.add_parser("token", help="mint a JWT for the JSON-RPC surface")
    token.add_argument("--sub", required=True, help="the user id (JWT sub)")
    token.add_argument("--ttl", type=int, default=3600, help="lifetime in seconds")
    token.add_argument(
        "--admin", action="store_true", help='add "role": "admin" (status and others\' memory)'
    )
