"""The published API description (``/openapi.json``) and the gateway held to it.

The chat route and ``/api/rpc`` publish their request bodies (the models that validate them),
and every route its answers. A bounded schemathesis run (a fixed seed, 20 examples an
operation; checks in ``schemathesis.toml`` beside this file) over the spec a real
``arona-gateway up`` publishes finds no 5xx, no status, content type, header or body outside
the spec, and no REST request the spec calls invalid accepted.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway_http.chat_request import ChatOptions
from tests.e2e.stack import running_stack

pytestmark = pytest.mark.asyncio

BIN = Path(sys.executable).parent
CONFIG = Path(__file__).with_name("schemathesis.toml")
EXAMPLES = 20
SEED = 26
RUN_TIMEOUT_S = 300


async def test_the_spec_publishes_the_chat_and_rpc_bodies(tmp_path: Path) -> None:
    async with running_stack(tmp_path, rpc_max_batch=7) as stack:
        response = await stack.http.get("/openapi.json")
        assert response.status_code == 200
        spec: dict[str, Any] = response.json()
        methods = stack.app.state.gateway.dispatcher.methods
    schemas = spec["components"]["schemas"]

    chat = spec["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    request = schemas["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(request["required"])
    # The optional fields REST checks as chat.send does are published as they are checked.
    assert set(ChatOptions.model_fields) <= set(request["properties"])
    assert {"type": "number"} in request["properties"]["temperature"]["anyOf"]
    assert {"415", "413", "400", "408", "431"} <= set(chat["responses"])

    rpc = spec["paths"]["/api/rpc"]["post"]
    one_or_batch = rpc["requestBody"]["content"]["application/json"]["schema"]["anyOf"]
    calls = one_or_batch[0]["anyOf"]
    assert sorted(c["properties"]["method"]["const"] for c in calls) == sorted(methods)
    send = next(c for c in calls if c["properties"]["method"]["const"] == "chat.send")
    params = schemas[send["properties"]["params"]["$ref"].rsplit("/", 1)[1]]
    assert params["additionalProperties"] is False
    assert "temperature" in params["properties"]
    assert one_or_batch[1]["maxItems"] == 7
    # Every answer under /v1 says what memory did, errors and the edge's refusals included.
    for path in ("/v1/chat/completions", "/v1/models", "/v1/conversations/{conversation_id}"):
        for operation in spec["paths"][path].values():
            for status, answer in operation["responses"].items():
                assert answer["headers"]["X-Arona-Memory"]["required"], (path, status)
    assert "headers" not in rpc["responses"]["408"]
    # No route is left with FastAPI's 422, which the gateway never answers.
    for operations in spec["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]


async def _banner(process: asyncio.subprocess.Process) -> tuple[str, str]:
    """The HTTP URL and the JWT ``up`` prints once it serves."""
    assert process.stdout is not None
    url = token = None
    while True:
        raw = await asyncio.wait_for(process.stdout.readline(), 120)
        assert raw, "arona-gateway up exited before it served"
        line = raw.decode()
        if found := re.match(r"\s+HTTP\s+(http://\S+)", line):
            url = found.group(1)
        if found := re.match(r"\s+JWT=(\S+)", line):
            token = found.group(1)
        if "Ctrl-C stops everything" in line:
            break
    assert url and token
    return url, token


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
async def test_a_bounded_schemathesis_run_finds_nothing_outside_the_spec(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(
        ARONA_DATA_DIR=str(tmp_path / "data"),
        ARONA_HTTP_PORT="0",
        ARONA_GRPC_PORT="0",
        # The word index alone: the run is about the HTTP surface, not the ranking.
        ARONA_STORE_RANKING="lexical",
    )
    gateway = await asyncio.create_subprocess_exec(
        str(BIN / "arona-gateway"),
        "up",
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        url, token = await _banner(gateway)
        run = await asyncio.create_subprocess_exec(
            str(BIN / "st"),
            "--config-file",
            str(CONFIG),
            "run",
            f"{url}/openapi.json",
            "--header",
            f"Authorization: Bearer {token}",
            "--max-examples",
            str(EXAMPLES),
            "--seed",
            str(SEED),
            "--workers",
            "1",
            "--no-color",
            cwd=tmp_path,
            env={**env, "SCHEMATHESIS_TELEMETRY": "false"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(run.communicate(), RUN_TIMEOUT_S)
    finally:
        gateway.send_signal(signal.SIGINT)
        await asyncio.wait_for(gateway.wait(), 60)
    report = output.decode(errors="replace")
    assert run.returncode == 0, report
    operations = re.search(r"(\d+) selected / (\d+) total", report)
    assert operations is not None and operations.group(1) == operations.group(2), report
    found = re.search(r"(\d+) generated, (\d+) passed", report)
    assert found is not None and found.group(1) == found.group(2), report
