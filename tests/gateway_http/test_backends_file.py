"""The backends file: which backend serves a model and in what order the others are asked, and
every mistake in a file reported on a line of its own (nothing else is started here; the
gateway running on such a file is tests/e2e/test_routing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway_http.upstream.backends_file import BackendsFile, BackendsFileError, load_backends
from tests.support.readme import fenced_blocks, region

ENV = {"OPENAI_API_KEY": "sk-openai-secret-0123456789", "ROUTER_KEY": "sk-or-secret-abcdef"}

FILE = """
[backends.openai]
base_url = "https://api.openai.com/v1"
api_key_env = "OPENAI_API_KEY"
models = ["gpt-*", "o1"]
aliases = { fast = "gpt-4o-mini" }

[backends.router]
base_url = "https://openrouter.ai/api/v1/"
api_key_env = "ROUTER_KEY"
timeout_s = 30
connect_timeout_s = 2.5
models = ["gpt-4o", "gpt-*", "*/*"]
aliases = { fast = "openai/gpt-4o-mini" }

[backends.local]
base_url = "http://127.0.0.1:11434/v1"
models = ["llama*"]

[fallbacks]
"gpt-4o" = ["router", { backend = "local", model = "llama3.1:8b" }, "router"]
"gpt-*" = ["router"]
"*" = [{ backend = "local", model = "llama3.1:8b" }]
"""


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> BackendsFile:
    path = tmp_path / "backends.toml"
    path.write_text(text)
    return load_backends(path, ENV if env is None else env)


def chain(backends: BackendsFile, model: str) -> list[tuple[str, str | None]]:
    return [(spec.name, sent) for spec, sent in backends.chain(model)]


def test_a_model_named_exactly_wins_over_a_glob_earlier_in_the_file(tmp_path: Path) -> None:
    backends = load(tmp_path, FILE)
    # openai's glob gpt-* comes first, router lists gpt-4o by name: the name wins.
    assert chain(backends, "gpt-4o")[0] == ("router", None)
    # Otherwise the first matching glob in file order.
    assert chain(backends, "gpt-3.5-turbo")[0] == ("openai", None)
    assert chain(backends, "meta/llama-3")[0] == ("router", None)
    assert chain(backends, "llama3.1:8b")[0] == ("local", None)
    # An alias rewrites the name sent; the first backend listing it serves it.
    assert chain(backends, "fast")[0] == ("openai", "gpt-4o-mini")
    assert chain(backends, "claude-3") == []


def test_fallbacks_come_in_order_from_the_exact_key_else_the_first_glob(tmp_path: Path) -> None:
    backends = load(tmp_path, FILE)
    # The exact key; the router entry twice and the primary itself are asked once.
    assert chain(backends, "gpt-4o") == [("router", None), ("local", "llama3.1:8b")]
    # The first glob key that matches: each backend sends the name as it serves it.
    assert chain(backends, "gpt-4-turbo") == [("openai", None), ("router", None)]
    # "*" catches the rest.
    assert chain(backends, "o1") == [("openai", None), ("local", "llama3.1:8b")]
    # An alias has the fallbacks of the model it names, and they are sent that model.
    assert chain(backends, "fast") == [("openai", "gpt-4o-mini"), ("router", "gpt-4o-mini")]


def test_what_can_be_listed_is_names_and_aliases_each_once(tmp_path: Path) -> None:
    backends = load(tmp_path, FILE)
    assert [(model, spec.name) for model, spec in backends.listed()] == [
        ("o1", "openai"),
        ("fast", "openai"),
        ("gpt-4o", "router"),
    ]


def test_keys_come_from_the_environment_and_timeouts_from_the_file(tmp_path: Path) -> None:
    backends = load(tmp_path, FILE)
    router = backends.backend("router")
    assert router is not None
    assert (router.api_key, router.timeout_s, router.connect_timeout_s) == (
        "sk-or-secret-abcdef",
        30.0,
        2.5,
    )
    local = backends.backend("local")
    assert local is not None and local.api_key is None
    assert (local.timeout_s, local.connect_timeout_s) == (600.0, 10.0)
    # Streams ask for their usage unless the file says the backend takes no stream_options.
    assert router.stream_usage and local.stream_usage
    quiet = load(
        tmp_path, FILE.replace('models = ["llama*"]', 'models = ["llama*"]\nstream_usage = false')
    )
    assert [spec.stream_usage for spec in quiet.backends] == [True, True, False]
    assert set(backends.secret_values) == set(ENV.values())
    # A key is never shown where the settings are printed.
    assert "sk-" not in repr(backends)


def problems(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(BackendsFileError) as caught:
        load(tmp_path, text, env)
    prefix = f"{tmp_path / 'backends.toml'}: "
    assert all(line.startswith(prefix) for line in caught.value.lines)
    assert str(caught.value).splitlines() == caught.value.lines
    return [line.removeprefix(prefix) for line in caught.value.lines]


def test_every_mistake_of_a_file_is_one_line(tmp_path: Path) -> None:
    text = """
[backends.openai]
base_url = "ftp://api.openai.com/v1"
api_key_env = "MISSING_API_KEY"
models = ["gpt-4o", "gpt-4o"]
timeout_s = "30"
aliases = { "gpt-*" = "gpt-4o" }

[backends.local]
base_url = "http://127.0.0.1:11434/v1"
retries = 3

[backends.router]
base_url = "https://openrouter.ai/api/v1"
models = ["*/*"]

[fallbacks]
"gpt-4o" = ["nobody", 7, { backend = "router" }]
"claude-3" = ["router"]

[general_settings]
"""
    assert problems(tmp_path, text) == [
        "general_settings: unknown section (the file has [backends.NAME] tables and a "
        "[fallbacks] table)",
        "backends.openai.timeout_s: Input should be a valid number",
        "backends.openai.base_url: must be an http:// or https:// URL with a host",
        "backends.openai.api_key_env: the environment variable MISSING_API_KEY is not set or empty",
        "backends.openai.models[1]: 'gpt-4o' is listed twice",
        'backends.openai.aliases."gpt-*": an alias is a name, not a glob (no * ? [)',
        "backends.local.retries: unknown setting (a backend has base_url, api_key_env, "
        "timeout_s, connect_timeout_s, models, aliases, prices, stream_usage, memory_role, "
        "api)",
        "backends.local: serves no model: give it models, aliases or both",
        "fallbacks.gpt-4o[0]: no backend named 'nobody' (backends: openai, local, router)",
        'fallbacks.gpt-4o[1]: must be a backend\'s name or { backend = "…", model = "…" }',
        "fallbacks.gpt-4o[2].model: missing (it is required)",
        # (Not "no backend serves claude-3": a broken backend may be the one meant to.)
        "fallbacks.claude-3[0]: backend 'router' does not serve 'claude-3': add it to its "
        'models or aliases, or write { backend = "router", model = "…" }',
    ]


def test_a_key_written_into_the_file_is_refused_and_never_echoed(tmp_path: Path) -> None:
    secret = "sk-live-do-not-print-me-42"
    text = f"""
[backends.a]
base_url = "https://user:{secret}@example.com/v1"
api_key = "{secret}"
api_key_env = "{secret}"
models = ["m"]

[backends.b]
base_url = "https://example.org/v1"
api_key_env = "AKIAIOSFODNN7EXAMPLE"
models = ["n"]
"""
    lines = problems(tmp_path, text)
    assert lines == [
        "backends.a.api_key: keys never go in this file: put the key in an environment "
        "variable and name the variable in api_key_env",
        "backends.a.base_url: must not carry credentials: put the key in an environment "
        "variable and name it in api_key_env",
        "backends.a.api_key_env: must be the name of an environment variable (letters, digits, "
        "'_'), not the key; the value is not shown",
        # A valid name that does not look like one (a key?) is not shown either.
        "backends.b.api_key_env: the environment variable (name not shown) is not set or empty",
    ]
    assert not any(secret in line or "AKIA" in line for line in lines)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "backends: no backend: add a [backends.NAME] table"),
        ("backends = 3", "backends: must hold one [backends.NAME] table per backend"),
        (
            '[backends."has space"]\nbase_url = "http://h/v1"\nmodels = ["m"]',
            "backends.\"has space\": a backend's name is up to 64 letters, digits, '-' and "
            "'_', starting with a letter or digit (it is sent in the X-Arona-Backend header)",
        ),
        (
            '[backends.a]\nbase_url = "http://h/v1"\nmodels = ["m"]\n[fallbacks]\nm = []',
            'fallbacks.m: must be a list of backends to try in order, e.g. ["backup"]',
        ),
        (
            '[backends.a]\nbase_url = "http://h/v1"\nmodels = ["m"]\naliases = { m = "n" }',
            "backends.a.aliases.m: 'm' is also in models: one or the other",
        ),
        (
            '[backends.a]\nbase_url = "http://h/v1"\nmodels = ["m"]\ntimeout_s = 0',
            "backends.a.timeout_s: Input should be greater than 0",
        ),
        ('[backends.a]\nmodels = ["m"]', "backends.a.base_url: missing (it is required)"),
        (
            '[backends.a]\nbase_url = "http://h/v1"\nmodels = ["m"]\nstream_usage = "no"',
            "backends.a.stream_usage: Input should be a valid boolean",
        ),
    ],
)
def test_one_mistake_one_line(tmp_path: Path, text: str, expected: str) -> None:
    assert problems(tmp_path, text) == [expected]


def test_a_file_that_is_not_toml_is_one_line_with_where(tmp_path: Path) -> None:
    [line] = problems(tmp_path, '[backends.a]\nbase_url = http://h/v1\nmodels = ["m"]\n')
    assert line == "not valid TOML: Invalid value (at line 2, column 12)"


def test_a_yaml_file_is_refused_with_a_pointer_to_toml(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("model_list: []\n")
    with pytest.raises(BackendsFileError) as caught:
        load_backends(path, ENV)
    assert caught.value.lines == [
        f"{path}: the backends file is TOML (a .yaml file is not read); docs/backends.md shows a "
        "LiteLLM config.yaml's parts in TOML"
    ]


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.toml"
    with pytest.raises(BackendsFileError) as caught:
        load_backends(path, ENV)
    assert caught.value.lines == [f"{path}: cannot read it: No such file or directory"]


def test_a_model_no_backend_serves_cannot_have_fallbacks(tmp_path: Path) -> None:
    text = '[backends.a]\nbase_url = "http://h/v1"\nmodels = ["m"]\n[fallbacks]\nclaude-3 = ["a"]'
    assert problems(tmp_path, text) == [
        "fallbacks.claude-3: no backend serves 'claude-3': add it to a backend's models or aliases",
        "fallbacks.claude-3[0]: backend 'a' does not serve 'claude-3': add it to its models or "
        'aliases, or write { backend = "a", model = "…" }',
    ]


def test_the_readme_example_is_a_valid_file_routing_as_it_says(tmp_path: Path) -> None:
    [text] = fenced_blocks(region("example", "backends"), "toml")
    env = {"OPENAI_API_KEY": "sk-o", "ANTHROPIC_API_KEY": "sk-a"}
    backends = load(tmp_path, text, env)
    assert chain(backends, "gpt-4o") == [("openai", None), ("anthropic", "claude-sonnet-4-5")]
    assert chain(backends, "fast") == [("openai", "gpt-4o-mini")]
    assert chain(backends, "o3-mini") == [("openai", None)]
    # An alias falls back as the model it names: "sonnet" is claude-sonnet-4-5, a "claude-*".
    assert chain(backends, "sonnet") == [("anthropic", "claude-sonnet-4-5"), ("openai", "gpt-4o")]
    assert chain(backends, "claude-opus-4-1") == [("anthropic", None), ("openai", "gpt-4o")]
    assert [model for model, _ in backends.listed()] == ["gpt-4o", "gpt-4o-mini", "fast", "sonnet"]


def test_a_name_to_show_in_a_hint_is_one_the_file_routes(tmp_path: Path) -> None:
    assert load(tmp_path, FILE).example_model() == "o1"
    globs_only = '[backends.a]\nbase_url = "http://h/v1"\nmodels = ["gpt-4o-[mn]*", "x?"]'
    assert load(tmp_path, globs_only).example_model() == "gpt-4o-m"


# Anthropic serves Claude models by glob and one by alias; the others serve some or all of them.
CLAUDE = """
[backends.anthropic]
base_url = "https://api.anthropic.com/v1"
models = ["claude-*"]
aliases = { sonnet = "claude-sonnet-4-5" }

[backends.alpha]
base_url = "http://127.0.0.1:8001/v1"
models = ["gpt-4o"]

[backends.beta]
base_url = "http://127.0.0.1:8002/v1"
models = ["claude-3-*", "claude-sonnet-4-5"]

[backends.gamma]
base_url = "http://127.0.0.1:8003/v1"
models = ["*"]

[backends.delta]
base_url = "http://127.0.0.1:8004/v1"
models = ["claude-*"]
aliases = { "claude-sonnet-4-5" = "claude-sonnet-4-5-eu" }
"""


def test_a_glob_key_refuses_a_backend_that_does_not_serve_what_it_matches(
    tmp_path: Path,
) -> None:
    text = CLAUDE + '[fallbacks]\n"claude-*" = ["alpha", "beta", "gamma", "delta"]\n'
    assert problems(tmp_path, text) == [
        # A name of the file is shown when there is one...
        "fallbacks.\"claude-*\"[0]: backend 'alpha' does not serve 'claude-sonnet-4-5', which "
        "'claude-*' matches: add 'claude-*' to its models, or write "
        '{ backend = "alpha", model = "…" }',
        # ... else the shortest model the key sends it that it does not serve.
        "fallbacks.\"claude-*\"[1]: backend 'beta' does not serve 'claude-', which 'claude-*' "
        "matches: add 'claude-*' to its models, or write "
        '{ backend = "beta", model = "…" }',
    ]


def test_a_glob_key_accepts_a_backend_serving_all_that_can_reach_it(tmp_path: Path) -> None:
    text = (
        CLAUDE
        + """
[backends.sonnets]
base_url = "http://127.0.0.1:8005/v1"
models = ["claude-sonnet-*"]

[fallbacks]
# An exact key, or an earlier glob key, takes what it names: the next key never sees those.
"claude-3-5-haiku" = ["gamma"]
"claude-3-*" = ["beta"]
"claude-sonnet-*" = ["sonnets", "delta"]
"*" = ["gamma", { backend = "alpha", model = "gpt-4o" }]
"""
    )
    backends = load(tmp_path, text)
    assert chain(backends, "claude-3-opus") == [("anthropic", None), ("beta", None)]
    assert chain(backends, "claude-sonnet-4") == [
        ("anthropic", None),
        ("sonnets", None),
        ("delta", None),
    ]
    assert chain(backends, "claude-opus-4-1") == [
        ("anthropic", None),
        ("gamma", None),
        ("alpha", "gpt-4o"),
    ]
    # Only models some backend serves reach a key: azure serves every gpt model there is.
    two = """
[backends.openai]
base_url = "https://api.openai.com/v1"
models = ["gpt-4o", "gpt-4o-mini"]

[backends.azure]
base_url = "http://127.0.0.1:8006/v1"
models = ["gpt-4o-mini", "gpt-4o"]

[fallbacks]
"gpt-*" = ["azure"]
"""
    assert chain(load(tmp_path, two), "gpt-4o-mini") == [("openai", None), ("azure", None)]


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (
            "claud-*",
            "fallbacks.\"claud-*\": no backend serves a model 'claud-*' matches: add one to a "
            "backend's models",
        ),
        (
            "son*",
            "fallbacks.\"son*\": no backend serves a model 'son*' matches; an alias has the "
            "fallbacks of the model it names ('sonnet': 'claude-sonnet-4-5'), so key them by "
            "that model",
        ),
    ],
)
def test_a_glob_key_matching_no_model_served_is_refused(
    tmp_path: Path, key: str, expected: str
) -> None:
    text = CLAUDE.replace('models = ["*"]', 'models = ["gpt-*"]')
    text += f'[fallbacks]\n"{key}" = [{{ backend = "gamma", model = "gpt-4o" }}]\n'
    assert problems(tmp_path, text) == [expected]


def test_an_alias_has_the_fallbacks_of_the_model_it_names(tmp_path: Path) -> None:
    text = (
        CLAUDE
        + """
[backends.openai]
base_url = "https://api.openai.com/v1"
models = ["gpt-4o"]
aliases = { fast = "gpt-4o-mini", omni = "gpt-4o", sonnet = "gpt-4o" }

[fallbacks]
"gpt-4o" = ["alpha"]
# Named by no backend's models: only the alias fast reaches it, and that is enough.
"gpt-4o-mini" = [{ backend = "gamma", model = "llama3.1:8b" }]
"claude-*" = ["gamma", "delta"]
"omni" = ["gamma"]
"""
    )
    backends = load(tmp_path, text)
    # By the model's exact key...
    assert chain(backends, "fast") == [("openai", "gpt-4o-mini"), ("gamma", "llama3.1:8b")]
    # ... or its glob key, each fallback getting the model (by its own alias, if it has one).
    assert chain(backends, "sonnet") == [
        ("anthropic", "claude-sonnet-4-5"),
        ("gamma", "claude-sonnet-4-5"),
        ("delta", "claude-sonnet-4-5-eu"),
    ]
    # A key naming the alias itself comes first.
    assert chain(backends, "omni") == [("openai", "gpt-4o"), ("gamma", None)]


def test_an_alias_glob_key_is_checked_against_the_model_it_names(tmp_path: Path) -> None:
    # fast is gpt-4o-mini, a "gpt-*": alpha, serving gpt-4o only, cannot stand in for it.
    text = (
        CLAUDE
        + """
[backends.openai]
base_url = "https://api.openai.com/v1"
models = ["gpt-4o"]
aliases = { fast = "gpt-4o-mini" }

[fallbacks]
"gpt-*" = ["alpha"]
"""
    )
    assert problems(tmp_path, text) == [
        "fallbacks.\"gpt-*\"[0]: backend 'alpha' does not serve 'gpt-4o-mini', which 'gpt-*' "
        'matches: add \'gpt-*\' to its models, or write { backend = "alpha", model = "…" }'
    ]


@pytest.mark.timeout(10)
def test_a_glob_key_over_hundreds_of_listed_models_is_checked_at_once(tmp_path: Path) -> None:
    models = [f"gpt-{size}-{n}" for n in range(300) for size in ("mini", "large")]
    listed = ", ".join(f'"{model}"' for model in models)
    text = f"""
[backends.openai]
base_url = "https://api.openai.com/v1"
models = [{listed}, "o*"]

[backends.azure]
base_url = "http://127.0.0.1:8007/v1"
models = [{listed.replace('"gpt-large-150", ', "")}]

[fallbacks]
"gpt-*" = ["azure"]
"""
    assert problems(tmp_path, text) == [
        "fallbacks.\"gpt-*\"[0]: backend 'azure' does not serve 'gpt-large-150', which 'gpt-*' "
        'matches: add \'gpt-*\' to its models, or write { backend = "azure", model = "…" }'
    ]
    backends = load(tmp_path, text.replace('"gpt-*" = ["azure"]', '"gpt-mini-*" = ["azure"]'))
    assert chain(backends, "gpt-mini-7") == [("openai", None), ("azure", None)]


def test_each_backend_names_the_role_of_its_memory_section(tmp_path: Path) -> None:
    backends = load(
        tmp_path,
        """
        [backends.reasoning]
        base_url = "http://127.0.0.1:9/v1"
        models = ["o1-mini"]
        memory_role = "developer"

        [backends.plain]
        base_url = "http://127.0.0.1:9/v1"
        models = ["llama"]
        """,
    )
    roles = {spec.name: spec.memory_role for spec in backends.backends}
    assert roles == {"reasoning": "developer", "plain": "system"}


def test_a_role_no_model_takes_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(BackendsFileError) as raised:
        load(
            tmp_path,
            """
            [backends.a]
            base_url = "http://127.0.0.1:9/v1"
            models = ["m"]
            memory_role = "assistant"
            """,
        )
    [line] = raised.value.lines
    assert line.endswith("backends.a.memory_role: Input should be 'system', 'developer' or 'user'")
