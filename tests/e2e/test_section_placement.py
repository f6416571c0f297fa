"""Where the memory section goes and in what role, end to end: the real gateway on every chat
surface, a scripted Philia, and recording upstreams (several, through a backends file).

What a user sees: by default the section comes first, as it always did; with
``ARONA_MEMORY_PLACEMENT=after_system`` the client's own system and developer messages keep
their place and their bytes, so a provider's prompt cache still matches them turn after turn;
a backend whose ``memory_role`` is ``developer`` or ``user`` gets the section in that role (a
fallback backend in its own); a context that already carries a section, in any role or place,
gets no second one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from gateway_http.upstream.backends_file import load_backends
from tests.e2e.stack import SURFACES, running_stack
from tests.support.fake_philia import QUERY
from tests.support.fake_upstream import Fail, FakeUpstream

pytestmark = pytest.mark.asyncio

# A long, stable system prompt: what a provider caches.
SYSTEM = {"role": "system", "content": "You are the travel desk of Nordlys Tours. " * 40}
DEVELOPER = {"role": "developer", "content": "Answer in one sentence."}
ASK = {"role": "user", "content": "Which tea do I prefer?"}
OOLONG = [{"node_type": "episode", "text": "I prefer oolong tea", "score": 0.83}]
OSLO = [{"node_type": "episode", "text": "I moved to Oslo in May", "score": 0.61}]
SECTION = "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea"
INJECTED = {"role": "system", "content": SECTION}


@pytest.mark.parametrize("surface", SURFACES)
async def test_first_keeps_the_seeds_order(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(OOLONG)
        turn = await stack.turn(surface, [SYSTEM, ASK])
        assert turn.memory == "enabled"
        assert stack.upstream.last_body["messages"] == [INJECTED, SYSTEM, ASK]


@pytest.mark.parametrize("surface", SURFACES)
async def test_after_system_keeps_the_clients_prefix(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path, memory_placement="after_system") as stack:
        stack.philia.memories = list(OOLONG)
        turn = await stack.turn(surface, [SYSTEM, DEVELOPER, ASK])
        assert turn.memory == "enabled"
        assert stack.upstream.last_body["messages"] == [SYSTEM, DEVELOPER, INJECTED, ASK]
        # Without a system prompt of its own, the section is simply first.
        await stack.turn(surface, [ASK])
        assert stack.upstream.last_body["messages"] == [INJECTED, ASK]


async def test_after_system_sends_the_same_prefix_bytes_whatever_is_recalled(
    tmp_path: Path,
) -> None:
    async def prefix_sent(stack: Any, memories: list[dict[str, Any]]) -> bytes:
        stack.philia.memories = memories
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="k", max_retries=0)
        async with client:
            await client.chat.completions.create(
                model="fake-model",
                messages=[SYSTEM, DEVELOPER, ASK],  # type: ignore[list-item]
            )
        raw = stack.upstream.chat_requests[-1].raw_body
        return bytes(raw[: raw.index(b"## Relevant Long-Term Memories")])

    async with running_stack(tmp_path / "after", memory_placement="after_system") as stack:
        oolong, oslo = await prefix_sent(stack, OOLONG), await prefix_sent(stack, OSLO)
        # Byte for byte up to the section: a prompt cache keyed on it hits on the next turn.
        assert oolong == oslo
        assert SYSTEM["content"].encode() in oolong
    async with running_stack(tmp_path / "first") as stack:
        # The seed's placement puts the section, and so what changes, before the system prompt.
        assert SYSTEM["content"].encode() not in await prefix_sent(stack, OOLONG)


ROLES = """
[backends.reasoning]
base_url = "{a}"
models = ["o1-mini"]
memory_role = "developer"

[backends.plain]
base_url = "{b}"
models = ["plain-model"]
memory_role = "user"

[fallbacks]
"o1-mini" = [{{ backend = "plain", model = "plain-model" }}]
"""


@pytest.mark.parametrize("placement", ["first", "after_system"])
async def test_each_backend_gets_the_section_in_its_own_role(
    tmp_path: Path, placement: str
) -> None:
    async with FakeUpstream.start() as a, FakeUpstream.start() as b:
        path = tmp_path / "backends.toml"
        path.write_text(ROLES.format(a=a.base_url, b=b.base_url))
        backends = load_backends(path, {})
        async with running_stack(
            tmp_path / "data", backends=backends, memory_placement=placement
        ) as stack:
            stack.philia.memories = list(OOLONG)
            at = 0 if placement == "first" else 1
            # The reasoning backend fails: its fallback answers, with the role it takes.
            a.script(Fail(status=503))
            turn = await stack.turn("rest", [SYSTEM, ASK], extra={"model": "o1-mini"})
            assert turn.status == 200 and turn.headers is not None
            assert turn.headers["x-arona-backend"] == "plain"
            assert a.last_body["messages"][at] == {"role": "developer", "content": SECTION}
            assert b.last_body["messages"][at] == {"role": "user", "content": SECTION}
            # The client's own messages are left as they were, around it.
            assert [m for i, m in enumerate(b.last_body["messages"]) if i != at] == [SYSTEM, ASK]
            # Recalled once for the turn, whatever the number of backends asked.
            assert len(stack.philia.frames_of(QUERY)) == 1


@pytest.mark.parametrize("placement", ["first", "after_system"])
@pytest.mark.parametrize("role", ["system", "developer", "user"])
async def test_a_context_carrying_a_section_gets_no_second_one(
    tmp_path: Path, placement: str, role: str
) -> None:
    async with running_stack(tmp_path, memory_placement=placement) as stack:
        stack.philia.memories = list(OOLONG)
        # As one gateway forwards to another: the section in its role and place.
        carried = {"role": role, "content": SECTION}
        sent = [carried, SYSTEM, ASK] if placement == "first" else [SYSTEM, DEVELOPER, carried, ASK]
        for surface in SURFACES:
            turn = await stack.turn(surface, sent)
            assert turn.memory == "disabled"
            assert stack.upstream.last_body["messages"] == sent
        assert stack.philia.frames_of(QUERY) == []


async def test_a_user_quoting_the_header_still_gets_memories(tmp_path: Path) -> None:
    async with running_stack(tmp_path, memory_placement="after_system") as stack:
        stack.philia.memories = list(OOLONG)
        quoting = {"role": "user", "content": f"What does this mean?\n{SECTION}"}
        turn = await stack.turn("rest", [SYSTEM, quoting])
        assert turn.memory == "enabled"
        assert stack.upstream.last_body["messages"] == [SYSTEM, INJECTED, quoting]
        [query] = stack.philia.frames_of(QUERY)
        assert query["params"]["query"] == quoting["content"]


@pytest.mark.parametrize("placement", ["first", "after_system"])
async def test_the_echo_model_shows_the_section_wherever_it_is_placed(
    tmp_path: Path, placement: str
) -> None:
    async with running_stack(tmp_path, upstream_url=None, memory_placement=placement) as stack:
        stack.philia.memories = list(OOLONG)
        for surface in SURFACES:
            turn = await stack.turn(surface, [SYSTEM, DEVELOPER, ASK], extra={"model": "echo"})
            assert turn.memory == "enabled"
            assert turn.content == f"Echo: {ASK['content']}\n\n{SECTION}"
