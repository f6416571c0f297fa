"""Prices in the backends file: what a turn costs on a backend (usage cost and cost budgets),
and a mistake in a price on a line of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway_http.upstream.backends_file import BackendsFileError, load_backends
from gateway_http.usage.records import Price

FILE = """
[backends.openai]
base_url = "https://api.openai.com/v1"
models = ["gpt-*"]
aliases = {{ fast = "gpt-4o-mini" }}
{prices}

[backends.local]
base_url = "http://127.0.0.1:11434/v1"
models = ["llama*"]
"""

PRICES = """
[backends.openai.prices]
"gpt-4o" = { input = 2.50, output = 10 }
"gpt-4o-*" = { input = 0.15, output = 0.60 }
"gpt-*" = { input = 1, output = 2 }
"""


def load(tmp_path: Path, prices: str) -> object:
    path = tmp_path / "backends.toml"
    path.write_text(FILE.format(prices=prices))
    return load_backends(path, {})


def test_a_model_is_priced_by_its_name_then_the_first_matching_glob(tmp_path: Path) -> None:
    path = tmp_path / "backends.toml"
    path.write_text(FILE.format(prices="") + PRICES)
    backends = load_backends(path, {})

    assert backends.price("openai", "gpt-4o") == Price(2.5, 10.0)
    # An alias is sent (and priced) as the model it stands for.
    assert backends.price("openai", "gpt-4o-mini") == Price(0.15, 0.6)
    assert backends.price("openai", "gpt-3.5-turbo") == Price(1.0, 2.0)
    assert backends.price("local", "llama3.1:8b") is None
    assert backends.price("nobody", "gpt-4o") is None
    assert Price(2.5, 10.0).cost_micro(1_000_000, 100_000) == 3_500_000


@pytest.mark.parametrize(
    ("prices", "line"),
    [
        (
            'prices = { "gpt-4o" = { input = "2.50", output = 10 } }',
            "backends.openai.prices.gpt-4o.input: Input should be a valid number",
        ),
        (
            'prices = { "gpt-4o" = { input = -1, output = 10 } }',
            "backends.openai.prices.gpt-4o.input: Input should be greater than or equal to 0",
        ),
        (
            'prices = { "gpt-4o" = { input = 1 } }',
            "backends.openai.prices.gpt-4o.output: missing (it is required)",
        ),
        (
            'prices = { "gpt-4o" = { input = 1, output = 2, currency = "EUR" } }',
            "backends.openai.prices.gpt-4o.currency: a price is { input = N, output = N }, "
            "each per million tokens (no other setting)",
        ),
        (
            'prices = { "gpt-4o" = 2.5 }',
            "backends.openai.prices.gpt-4o: a price is { input = N, output = N }, "
            "each per million tokens",
        ),
    ],
)
def test_a_bad_price_is_one_line(tmp_path: Path, prices: str, line: str) -> None:
    with pytest.raises(BackendsFileError) as refused:
        load(tmp_path, prices)

    assert len(refused.value.lines) == 1
    assert line in refused.value.lines[0]
