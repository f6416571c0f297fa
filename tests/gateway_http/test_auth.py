"""JWT verification/minting and REST API keys, as callers and operators see them."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any

import jwt
import pytest

from gateway_http.auth import (
    ApiKeys,
    AuthError,
    InvalidSubject,
    JwtVerifier,
    Principal,
    RestAuth,
    RpcAuth,
    bearer,
    memory_scope,
    mint_token,
    parse_key_entry,
)

# 64 bytes, so the HS512 case below is refused for its algorithm, not its key length.
SECRET = "test-secret-" + "0123456789abcdef" * 3 + "01234"
OTHER_SECRET = "other-secret-" + "0123456789abcdef" * 3 + "0123"


def _b64(obj: dict[str, Any]) -> str:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _sign(claims: dict[str, Any], secret: str = SECRET, algorithm: str = "HS256") -> str:
    return jwt.encode(claims, secret, algorithm=algorithm)


def _alg_none(claims: dict[str, Any]) -> str:
    # Crafted by hand: PyJWT would refuse to produce this for us to send.
    return f"{_b64({'alg': 'none', 'typ': 'JWT'})}.{_b64(claims)}."


def _future() -> int:
    # Some tokens are made at collection: a day, so none of them is refused for being expired
    # instead of for its own fault, however long the suite takes to reach it.
    return int(time.time()) + 24 * 3600


def test_valid_token_yields_its_subject() -> None:
    token = _sign({"sub": "alice", "exp": _future()})
    assert JwtVerifier(SECRET).verify(token) == "alice"


def test_minted_token_verifies_and_expires_after_ttl() -> None:
    before = int(time.time())
    token = mint_token(SECRET, "bob", ttl_s=120)
    assert JwtVerifier(SECRET).verify(token) == "bob"
    claims = jwt.decode(token, SECRET, algorithms=["HS256"])
    assert jwt.get_unverified_header(token)["alg"] == "HS256"
    assert before + 120 <= claims["exp"] <= int(time.time()) + 120


@pytest.mark.parametrize(
    ("label", "token"),
    [
        ("missing", None),
        ("empty", ""),
        ("malformed", "not-a-jwt"),
        ("three garbage segments", "a.b.c"),
        ("wrong signature", _sign({"sub": "alice", "exp": _future()}, OTHER_SECRET)),
        ("alg none", _alg_none({"sub": "alice", "exp": _future()})),
        ("HS512 not allowed", _sign({"sub": "alice", "exp": _future()}, algorithm="HS512")),
        ("expired", _sign({"sub": "alice", "exp": int(time.time()) - 60})),
        ("no exp", _sign({"sub": "alice"})),
        ("no sub", _sign({"exp": _future()})),
        ("numeric sub", _sign({"sub": 42, "exp": _future()})),
        ("not yet valid", _sign({"sub": "alice", "exp": _future(), "nbf": _future()})),
        ("non-ascii garbage", "ü.ü.ü"),
    ],
)
def test_bad_tokens_are_refused_without_echoing_them(label: str, token: str | None) -> None:
    with pytest.raises(AuthError) as info:
        JwtVerifier(SECRET).verify(token)
    assert str(info.value) == "Authentication required"
    if token:
        assert token not in str(info.value)
        assert token not in info.value.reason


@pytest.mark.parametrize(
    "sub",
    ["", "   ", "key:team-a", "KEY:team-a", "alice/bob", "/", "x" * 129, "a\nb", "tab\there"],
)
def test_a_sub_that_could_take_another_principal_is_refused_saying_why(sub: str) -> None:
    """``key:team-a`` would be that API key's memory, ``alice/bob`` alice's ``user=bob``."""
    token = _sign({"sub": sub, "exp": _future()})
    with pytest.raises(InvalidSubject) as info:
        JwtVerifier(SECRET).verify(token)
    assert str(info.value) == (
        "the token's 'sub' must be 1 to 128 printable characters, without '/', "
        "not starting with 'key:'"
    )
    with pytest.raises(ValueError, match="sub must be 1 to 128 printable"):
        mint_token(SECRET, sub)


@pytest.mark.parametrize("sub", ["alice", "ops@example.com", "x" * 128, "Zoë Ångström", "k:ey"])
def test_subs_that_name_one_caller_are_taken(sub: str) -> None:
    assert JwtVerifier(SECRET).verify(mint_token(SECRET, sub)) == sub


@pytest.mark.parametrize("secret", [None, ""])
def test_no_secret_configured_refuses_every_token(secret: str | None) -> None:
    verifier = JwtVerifier(secret)
    assert not verifier.configured
    for token in (mint_token(SECRET, "alice"), _alg_none({"sub": "alice", "exp": _future()})):
        with pytest.raises(AuthError, match="Authentication required"):
            verifier.verify(token)


@pytest.mark.parametrize(
    ("secret", "sub", "ttl"),
    [("", "alice", 60), (SECRET, "", 60), (SECRET, "  ", 60), (SECRET, "alice", 0)],
)
def test_mint_token_rejects_unusable_arguments(secret: str, sub: str, ttl: int) -> None:
    with pytest.raises(ValueError):
        mint_token(secret, sub, ttl_s=ttl)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),
        ("  Bearer   abc  ", "abc"),
        ("Bearer", None),
        ("Bearer   ", None),
        ("Basic abc", None),
        ("abc", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_extracts_only_bearer_credentials(header: str | None, expected: str | None) -> None:
    assert bearer(header) == expected


def test_open_api_keys_let_everyone_in_as_anonymous() -> None:
    keys = ApiKeys(())
    assert keys.open
    assert keys.owner(None) == "anonymous"
    assert keys.owner("Bearer whatever") == "anonymous"


def test_configured_key_maps_to_an_owner_that_is_not_the_key() -> None:
    keys = ApiKeys(("key-one-secret", "key-two-secret"))
    assert not keys.open
    one = keys.owner("Bearer key-one-secret")
    two = keys.owner("Bearer key-two-secret")
    assert one != two
    assert one == keys.owner("Bearer key-one-secret")  # stable across requests
    assert one == "key:" + hashlib.sha256(b"key-one-secret").hexdigest()[:16]
    assert "key-one-secret" not in one and "key-two-secret" not in two


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer wrong",
        "Basic key-one-secret",
        "Bearer key-one-secre",
        "Bearer ü",
    ],
)
def test_missing_or_unknown_key_is_refused(header: str | None) -> None:
    keys = ApiKeys(("key-one-secret",))
    with pytest.raises(AuthError) as info:
        keys.owner(header)
    assert "key-one-secret" not in str(info.value)
    assert str(info.value) == "Invalid or missing API key"


def test_only_empty_keys_fail_closed() -> None:
    keys = ApiKeys(("",))
    assert not keys.open
    with pytest.raises(AuthError):
        keys.owner("Bearer ")
    with pytest.raises(AuthError):
        keys.owner(None)


@pytest.mark.parametrize(
    ("entry", "principal", "key"),
    [
        ("team-a=sk-abc123", "key:team-a", "sk-abc123"),
        ("ops.eu_1=k=v", "key:ops.eu_1", "k=v"),
        # Base64 padding and odd names are parts of a bare key, not names.
        ("c2VjcmV0a2V5==", None, "c2VjcmV0a2V5=="),
        ("abc=", None, "abc="),
        ("two words=key", None, "two words=key"),
        ("=key", None, "=key"),
        ("plain-key", None, "plain-key"),
    ],
)
def test_key_entries_are_named_or_bare(entry: str, principal: str | None, key: str) -> None:
    got_principal, got_key = parse_key_entry(entry)
    assert got_key == key
    if principal is None:
        assert got_principal == "key:" + hashlib.sha256(entry.encode()).hexdigest()[:16]
    else:
        assert got_principal == principal


def test_rest_callers_are_a_key_or_a_jwt_sub() -> None:
    keys = ApiKeys(("team-a=sk-team-a", "sk-bare"))
    rest = RestAuth(keys, JwtVerifier(SECRET))
    assert rest.principal("Bearer sk-team-a") == Principal("key:team-a")
    assert rest.principal("Bearer sk-bare") == Principal(parse_key_entry("sk-bare")[0])
    assert rest.principal(f"Bearer {mint_token(SECRET, 'alice')}") == Principal("alice")
    admin = mint_token(SECRET, "ops", admin=True)
    assert rest.principal(f"Bearer {admin}") == Principal("ops", admin=True)
    for header in (None, "Bearer nope", f"Bearer {mint_token(OTHER_SECRET, 'alice')}"):
        with pytest.raises(AuthError):
            rest.principal(header)


def test_open_rest_knows_jwt_holders_and_nobody_else() -> None:
    rest = RestAuth(ApiKeys(()), JwtVerifier(SECRET))
    assert rest.principal(f"Bearer {mint_token(SECRET, 'alice')}") == Principal("alice")
    assert rest.principal(None) is None
    assert rest.principal("Bearer unused-when-rest-is-open") is None
    assert rest.principal(f"Bearer {mint_token(OTHER_SECRET, 'alice')}") is None


def test_json_rpc_callers_are_a_key_or_a_jwt_sub_and_keys_are_never_admins() -> None:
    keys = ApiKeys(("team-a=sk-team-a", "sk-bare"))
    rpc = RpcAuth(JwtVerifier(SECRET), keys)
    assert rpc.principal("sk-team-a") == Principal("key:team-a", admin=False)
    assert rpc.principal("sk-bare") == Principal(parse_key_entry("sk-bare")[0])
    assert rpc.principal(mint_token(SECRET, "ops", admin=True)) == Principal("ops", admin=True)
    for token in (None, "", "nope", "sk-team-", mint_token(OTHER_SECRET, "alice")):
        with pytest.raises(AuthError):
            rpc.principal(token)
    # Without a JWT secret the keys still work, and no JWT does.
    no_secret = RpcAuth(JwtVerifier(None), keys)
    assert no_secret.principal("sk-team-a") == Principal("key:team-a")
    with pytest.raises(AuthError):
        no_secret.principal(mint_token(SECRET, "alice"))
    # Open REST (no keys): a bearer is a JWT or nothing.
    with pytest.raises(AuthError):
        RpcAuth(JwtVerifier(SECRET), ApiKeys(())).principal("sk-team-a")


def test_the_user_field_only_narrows_a_principal() -> None:
    assert memory_scope(Principal("alice"), None) == "alice"
    assert memory_scope(Principal("alice"), "") == "alice"
    assert memory_scope(Principal("key:team-a"), "bob") == "key:team-a/bob"
    assert memory_scope(None, "bob") is None


def test_an_admin_token_says_so() -> None:
    verifier = JwtVerifier(SECRET)
    assert verifier.principal(mint_token(SECRET, "ops", admin=True)) == Principal("ops", True)
    assert verifier.principal(mint_token(SECRET, "ops")) == Principal("ops", False)
    other_role = _sign({"sub": "eve", "exp": _future(), "role": "Admin"})
    assert verifier.principal(other_role) == Principal("eve", False)
