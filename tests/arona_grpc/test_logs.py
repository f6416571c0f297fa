"""Request ids and the two log formats."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from arona_grpc.logs import (
    REQUEST_ID,
    JsonFormatter,
    RequestIdFilter,
    TextFormatter,
    request_id_or_new,
    sane_request_id,
)

SECRET = "s3cr3t-token-value"


def _record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError(f"boom with {SECRET}")
        except RuntimeError as error:
            exc_info = (type(error), error, error.__traceback__)
    record = logging.LogRecord("arona.test", logging.WARNING, __file__, 1, message, args, exc_info)
    RequestIdFilter().filter(record)
    return record


@pytest.mark.parametrize(
    ("value", "sane"),
    [
        ("abc-123", True),
        ("x" * 128, True),
        ("with spaces/and.dots", True),
        ("x" * 129, False),
        ("", False),
        (None, False),
        ("tab\there", False),
        ("new\nline", False),
        ("caf\u00e9", False),
    ],
)
def test_sane_request_ids(value: str | None, sane: bool) -> None:
    assert sane_request_id(value) == (value if sane else None)
    replaced = request_id_or_new(value)
    assert replaced == value if sane else len(replaced) == 32


def test_text_lines_carry_the_request_id_and_mask_secrets() -> None:
    token = REQUEST_ID.set("rid-1")
    try:
        line = TextFormatter([SECRET, None]).format(_record("token was %s", SECRET))
    finally:
        REQUEST_ID.reset(token)
    assert " arona.test [rid-1]: token was ***" in line
    plain = TextFormatter().format(_record("no request"))
    assert plain.endswith(" WARNING arona.test: no request")


def test_json_lines_are_one_object_with_the_fields() -> None:
    async def in_a_request() -> str:
        REQUEST_ID.set("rid-2")
        return JsonFormatter([SECRET]).format(_record("failed for %s", SECRET, exc=True))

    line = asyncio.run(in_a_request())
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "warning"
    assert entry["logger"] == "arona.test"
    assert entry["message"] == "failed for ***"
    assert entry["request_id"] == "rid-2"
    assert "RuntimeError: boom with ***" in entry["exception"]
    assert SECRET not in line
    # Outside a request (the task above had its own context): no id.
    assert json.loads(JsonFormatter().format(_record("idle")))["request_id"] is None


@pytest.mark.parametrize(
    ("secret", "line", "shown"),
    [
        # A one-letter token: the words that hold the letter are left alone.
        (
            "x",
            "embedding model all-MiniLM-L6-v2-onnx-int8 loaded (plaintext, x-arona-memory)",
            "embedding model all-MiniLM-L6-v2-onnx-int8 loaded (plaintext, x-arona-memory)",
        ),
        (
            "x",
            "connecting to ws://h/ws?token=x&a=1 with x",
            "connecting to ws://h/ws?token=***&a=1 with ***",
        ),
        (
            "CHANGE_ME",
            "token CHANGE_ME, not CHANGE_MEANT or NOCHANGE_ME",
            "token ***, not CHANGE_MEANT or NOCHANGE_ME",
        ),
        # A secret whose ends are not word characters is masked wherever it is.
        ("p@ss!", "password=p@ss!word", "password=***word"),
    ],
)
def test_a_secret_is_masked_where_it_stands_whole(secret: str, line: str, shown: str) -> None:
    formatted = TextFormatter([secret]).format(_record("%s", line))
    assert formatted.endswith(f"arona.test: {shown}")


def test_a_url_is_masked_whole_before_the_password_in_it() -> None:
    url = "postgresql://arona:pw-1234567890@db/arona"
    line = TextFormatter(["pw-1234567890", url]).format(_record("opened %s; pw-1234567890", url))
    assert line.endswith("arona.test: opened ***; ***")
