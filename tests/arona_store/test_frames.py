"""Frame encoding and decoding of the store: fast for ordinary frames, and the rare
frames the fast codec refuses are read and written as JSON allows."""

from __future__ import annotations

import json

import pytest

from arona_store.jsonrpc import PARSE_ERROR, RpcError, parse_call, result_frame


def test_an_ordinary_frame_round_trips() -> None:
    call = parse_call('{"jsonrpc":"2.0","id":7,"method":"M","params":{"query":"thé ☕"}}')
    assert (call.request_id, call.method, call.params) == (7, "M", {"query": "thé ☕"})
    frame = result_frame(7, {"text": "thé ☕", "score": 0.25})
    assert json.loads(frame) == {
        "jsonrpc": "2.0",
        "id": 7,
        "result": {"text": "thé ☕", "score": 0.25},
    }


def test_a_lone_surrogate_escape_still_parses() -> None:
    call = parse_call('{"jsonrpc":"2.0","id":"1","method":"M","params":{"query":"a\\ud800b"}}')
    assert call.params["query"] == "a\ud800b"


def test_text_that_is_not_utf8_is_sent_escaped() -> None:
    frame = result_frame("1", {"text": "a\ud800b"})
    frame.encode("utf-8")  # a text frame must be valid UTF-8
    assert json.loads(frame)["result"]["text"] == "a\ud800b"


def test_garbage_is_a_parse_error() -> None:
    with pytest.raises(RpcError) as raised:
        parse_call("{not json")
    assert raised.value.code == PARSE_ERROR
