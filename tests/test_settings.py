"""Settings from the environment, exactly as the configuration table says."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from arona_common.redact import redact_url
from arona_grpc.config import ConfigError, Settings
from tests.support.readme import DOCS, VARIABLE, gateway_variables


def test_defaults() -> None:
    s = Settings.from_env({})
    assert (s.memory_url, s.memory_token, s.memory_enabled) == (None, None, False)
    assert s.memory_writeback is True and s.memory_timeout_s == 10.0
    assert (s.http_host, s.http_port, s.grpc_host, s.grpc_port) == (
        "127.0.0.1",
        8080,
        "127.0.0.1",
        50051,
    )
    assert s.effective_grpc_target == "127.0.0.1:50051"
    assert s.data_dir == Path(".arona") and s.log_level == "info"
    assert s.api_keys == () and s.jwt_secret is None and s.upstream_url is None
    assert s.recall_budget_s == 10.0


@pytest.mark.parametrize(
    ("url", "token", "enabled"),
    [
        ("ws://h/ws", "t", True),
        ("ws://h/ws", "", False),
        ("", "t", False),
        ("  ", "t", False),
        ("ws://h/ws", "   ", False),
    ],
)
def test_enabled_iff_url_and_token_are_both_non_empty(url: str, token: str, enabled: bool) -> None:
    env = {"ARONA_MEMORY_URL": url, "ARONA_MEMORY_TOKEN": token}
    assert Settings.from_env(env).memory_enabled is enabled


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("false", False)])
def test_writeback_accepts_exactly_true_and_false(
    value: str, expected: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert Settings.from_env({"ARONA_MEMORY_WRITEBACK": value}).memory_writeback is expected
    assert caplog.records == []


@pytest.mark.parametrize("value", ["0", "1", "yes", "False", "TRUE", "", " true"])
def test_other_writeback_values_warn_and_keep_the_default(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert Settings.from_env({"ARONA_MEMORY_WRITEBACK": value}).memory_writeback is True
    assert any("ARONA_MEMORY_WRITEBACK" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"ARONA_MEMORY_STREAM_WRITEBACK": "true"}, True),
        ({"ARONA_MEMORY_STREAM_WRITEBACK": "false"}, False),
    ],
)
def test_stream_writeback_is_off_unless_exactly_true(
    env: dict[str, str], expected: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert Settings.from_env(env).memory_stream_writeback is expected
    assert caplog.records == []


@pytest.mark.parametrize("value", ["1", "yes", "True", "on", "", " true"])
def test_other_stream_writeback_values_warn_and_keep_it_off(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"ARONA_MEMORY_STREAM_WRITEBACK": value}
    with caplog.at_level(logging.WARNING):
        assert Settings.from_env(env).memory_stream_writeback is False
    [warning] = caplog.records
    assert "ARONA_MEMORY_STREAM_WRITEBACK" in warning.getMessage()
    assert "keeping the default (false)" in warning.getMessage()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ARONA_HTTP_PORT", "http"),
        ("ARONA_GRPC_PORT", "70000"),
        ("ARONA_HTTP_PORT", "-1"),
        ("ARONA_MEMORY_TIMEOUT_S", "0"),
        ("ARONA_MEMORY_TIMEOUT_S", "soon"),
        ("ARONA_LOG_LEVEL", "loud"),
    ],
)
def test_unusable_values_fail_with_one_line_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({name: value})
    assert name in str(raised.value) and "\n" not in str(raised.value)


def test_short_jwt_secret_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({"ARONA_JWT_SECRET": "s3cr3t-but-short"})
    assert "s3cr3t" not in str(raised.value)
    long_enough = "x" * 32
    assert Settings.from_env({"ARONA_JWT_SECRET": long_enough}).jwt_secret == long_enough


def test_secrets_are_not_in_the_settings_repr() -> None:
    s = Settings.from_env(
        {
            "ARONA_MEMORY_TOKEN": "tok-123",
            "ARONA_JWT_SECRET": "j" * 40,
            "ARONA_API_KEYS": "key-1, key-2",
            "ARONA_UPSTREAM_API_KEY": "sk-999",
            "ARONA_GRPC_TOKEN": "grpc-777",
        }
    )
    assert s.api_keys == ("key-1", "key-2")
    text = repr(s)
    assert not any(
        secret in text for secret in ("tok-123", "j" * 40, "key-1", "sk-999", "grpc-777")
    )


def test_grpc_token_and_tls_files() -> None:
    s = Settings.from_env({})
    assert (s.grpc_token, s.grpc_tls_cert, s.grpc_tls_key, s.grpc_tls_ca) == (None,) * 4
    s = Settings.from_env(
        {
            "ARONA_GRPC_TOKEN": " grpc-777 ",
            "ARONA_GRPC_TLS_CERT": "/etc/arona/server.pem",
            "ARONA_GRPC_TLS_KEY": "/etc/arona/server-key.pem",
            "ARONA_GRPC_TLS_CA": "ca.pem",
            "ARONA_GRPC_TARGET": "",
        }
    )
    assert s.grpc_token == "grpc-777"
    assert (s.grpc_tls_cert, s.grpc_tls_key, s.grpc_tls_ca) == (
        Path("/etc/arona/server.pem"),
        Path("/etc/arona/server-key.pem"),
        Path("ca.pem"),
    )
    assert Settings.from_env({"ARONA_GRPC_TOKEN": "  ", "ARONA_GRPC_TLS_CA": ""}) == Settings()


def test_grpc_target_follows_the_listener_unless_set() -> None:
    assert (
        Settings.from_env(
            {"ARONA_GRPC_HOST": "0.0.0.0", "ARONA_GRPC_PORT": "6000"}
        ).effective_grpc_target
        == "127.0.0.1:6000"
    )
    assert Settings.from_env({"ARONA_GRPC_HOST": "::"}).effective_grpc_target == "[::1]:50051"
    assert (
        Settings.from_env({"ARONA_GRPC_TARGET": "memory.internal:7000"}).effective_grpc_target
        == "memory.internal:7000"
    )


def test_grpc_replicas_and_streams() -> None:
    settings = Settings.from_env({"ARONA_GRPC_TARGET": " mem-a:50051, mem-b:50051 ,"})
    assert settings.grpc_targets == ("mem-a:50051", "mem-b:50051")
    assert settings.grpc_streams == 2
    assert Settings.from_env({}).grpc_targets == ("127.0.0.1:50051",)
    assert Settings.from_env({"ARONA_GRPC_STREAMS": "0"}).grpc_streams == 0
    assert Settings.from_env({"ARONA_GRPC_STREAMS": "8"}).grpc_streams == 8
    for bad in ("-1", "two", "65", "1.5"):
        with pytest.raises(ConfigError) as raised:
            Settings.from_env({"ARONA_GRPC_STREAMS": bad})
        assert str(raised.value) == (
            f"ARONA_GRPC_STREAMS must be a whole number from 0 (unary calls) to 64, got {bad!r}"
        )


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("ws://h:8424/ws?token=abc%2Fdef", "ws://h:8424/ws?token=***"),
        ("ws://h/ws?a=1&token=t", "ws://h/ws?a=1&token=***"),
        ("wss://user:pw@h/ws", "wss://***@h/ws"),
        ("ws://h/ws", "ws://h/ws"),
    ],
)
def test_redact_url_hides_tokens_and_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_observability_settings() -> None:
    default = Settings.from_env({})
    assert (default.log_format, default.metrics, default.metrics_token) == ("text", True, None)
    assert default.grpc_metrics_port is None
    s = Settings.from_env(
        {
            "ARONA_LOG_FORMAT": "JSON",
            "ARONA_METRICS": "false",
            "ARONA_METRICS_TOKEN": "scrape-me",
            "ARONA_GRPC_METRICS_PORT": "9464",
        }
    )
    assert (s.log_format, s.metrics, s.grpc_metrics_port) == ("json", False, 9464)
    assert "scrape-me" not in repr(s)
    assert Settings.from_env({"ARONA_GRPC_METRICS_PORT": "0"}).grpc_metrics_port == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [("ARONA_LOG_FORMAT", "yaml"), ("ARONA_GRPC_METRICS_PORT", "70000")],
)
def test_bad_observability_values_stop_start_up(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({name: value})


def test_secret_values_name_every_configured_secret() -> None:
    s = Settings.from_env(
        {
            "ARONA_MEMORY_TOKEN": "mem-token",
            "ARONA_JWT_SECRET": "j" * 40,
            "ARONA_UPSTREAM_API_KEY": "up-key",
            "ARONA_METRICS_TOKEN": "metrics-token",
            "ARONA_API_KEYS": "team-a=sk-team-a,bare-key",
        }
    )
    assert set(s.secret_values) >= {
        "mem-token",
        "j" * 40,
        "up-key",
        "metrics-token",
        "sk-team-a",
        "bare-key",
    }


def test_several_memory_urls_in_order_each_once(caplog: pytest.LogCaptureFixture) -> None:
    env = {
        "ARONA_MEMORY_URL": " ws://a:1/ws , ws://b:2/ws?token=x ,, ws://a:1/ws",
        "ARONA_MEMORY_TOKEN": "t0k3n",
    }
    with caplog.at_level(logging.WARNING):
        settings = Settings.from_env(env)
    assert settings.memory_urls == ("ws://a:1/ws", "ws://b:2/ws?token=x")
    assert settings.memory_enabled
    assert "names a store more than once" in caplog.text and "token=x" not in caplog.text
    assert not Settings(memory_url=" , ", memory_token="t0k3n").memory_enabled
    assert Settings(memory_url="ws://a:1/ws").memory_urls == ("ws://a:1/ws",)


def test_memory_placement_is_first_unless_after_system() -> None:
    assert Settings.from_env({}).memory_placement == "first"
    env = {"ARONA_MEMORY_PLACEMENT": "after_system"}
    assert Settings.from_env(env).memory_placement == "after_system"
    for wrong in ("last", "After_System", "system"):
        with pytest.raises(ConfigError) as raised:
            Settings.from_env({"ARONA_MEMORY_PLACEMENT": wrong})
        assert "ARONA_MEMORY_PLACEMENT" in str(raised.value) and "\n" not in str(raised.value)


def test_a_v1_body_fits_openais_and_json_rpc_keeps_its_own_limit() -> None:
    s = Settings.from_env({})
    # OpenAI takes images of up to 20 MB (27 MB as a base64 data URL) and 25 MB audio uploads.
    assert s.http_max_body_bytes >= 20 * 10**6 * 4 // 3 + 1024
    assert s.rpc_max_body_bytes == 1 << 20
    s = Settings.from_env({"ARONA_HTTP_MAX_BODY_BYTES": "5000", "ARONA_RPC_MAX_BODY_BYTES": "7000"})
    assert (s.http_max_body_bytes, s.rpc_max_body_bytes) == (5000, 7000)


# Read only to say they are no longer used (a warning names the replacement).
RETIRED = {"ARONA_MEMORY_OUTBOX_MAX"}


def _documented_rows() -> dict[str, str]:
    """The configuration reference's table rows that document variables: each variable of a
    row's first cell, and that row's default cell."""
    rows: dict[str, str] = {}
    for line in (DOCS / "reference" / "configuration.md").read_text().splitlines():
        if not line.startswith("| `ARONA_"):
            continue
        cells = line.split(" | ")
        for name in VARIABLE.findall(cells[0]):
            rows[name] = cells[1]
    return rows


def test_the_configuration_reference_documents_every_variable_the_gateway_reads() -> None:
    rows = _documented_rows()
    assert sorted(gateway_variables() - RETIRED - set(rows)) == []
    # The defaults of the limits a chat body meets, as the settings have them.
    defaults = Settings()
    assert rows["ARONA_HTTP_MAX_BODY_BYTES"].startswith(f"`{defaults.http_max_body_bytes}`")
    assert rows["ARONA_RPC_MAX_BODY_BYTES"].startswith(f"`{defaults.rpc_max_body_bytes}`")
    assert rows["ARONA_MEMORY_PLACEMENT"] == f"`{defaults.memory_placement}`"
