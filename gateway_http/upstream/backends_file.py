"""The backends file (``ARONA_BACKENDS=path``): named upstreams, the models each serves, and the
fallbacks of each model, read and checked once at start-up.

The file is TOML (read with the standard library's ``tomllib``)::

    [backends.openai]
    base_url = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"        # the variable's name; a key is never in the file
    timeout_s = 600                       # the longest silence while an answer is awaited
    connect_timeout_s = 10
    models = ["gpt-4o", "gpt-4o-mini", "o*"]           # exact names and globs
    api = "responses"                     # or "chat": it serves chat completions only
    aliases = { fast = "gpt-4o-mini" }                 # asked as `fast`, sent as gpt-4o-mini
    # Per million tokens, by the name sent (exact or glob): usage cost and cost budgets.
    prices = { "gpt-4o" = { input = 2.50, output = 10.00 } }
    stream_usage = true                   # false: never sent stream_options (usage estimated)
    memory_role = "system"                # the injected memory section's role (or developer, user)

    [fallbacks]
    "gpt-4o" = ["openrouter", { backend = "local", model = "llama3.1:8b" }]

Each part is checked on its own (its schema is a pydantic model per table), so a file with
several mistakes gets all of them, one line each (:class:`BackendsFileError`), and nothing
starts. The checked file becomes a :class:`BackendsFile`: plain frozen data that also answers
which backends serve a model, in what order, and under what name (:meth:`BackendsFile.chain`).

A model is served by the first backend, in file order, that lists it by exact name or alias;
failing that, by the first whose glob matches it. Its fallbacks come from the ``[fallbacks]`` key
that names it exactly; an alias without one has those of the model it names (as if that model
had been asked); otherwise the first glob key that matches. A fallback entry is a backend's name
(the model as that backend serves it: its alias, or the same name) or a table ``{backend,
model}`` (that model name, sent as it is). A backend named under a glob key must serve every
model the key can send it (:func:`~gateway_http.upstream.globs.example` finds one it does not).
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from pydantic import ValidationError as PydanticValidationError
from yarl import URL

from arona_grpc.config import ConfigError
from gateway_http.upstream.client import (
    DEFAULT_CONNECT_TIMEOUT_S,
    RESPONSES_API,
    valid_base_url,
)
from gateway_http.upstream.globs import Undecided, example, literal
from gateway_http.usage.records import Price

DEFAULT_TIMEOUT_S = 600.0
# A backend's name goes into the X-Arona-Backend header and into log lines.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
# What an environment variable's name may be.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A name shown back in an error line: conventional (OPENAI_API_KEY). Anything else is not
# echoed, in case it is the key itself written where its variable's name belongs.
_SHOWN_ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")
_GLOB_CHARS = frozenset("*?[")
_SECTIONS = ("backends", "fallbacks")

NonEmpty = Annotated[StrictStr, Field(min_length=1)]
# Strict: a number (an integer is one), never a string or a boolean.
Seconds = Annotated[float, Field(gt=0, le=86_400, strict=True)]
# A price per million tokens, in the operator's currency.
PerMillion = Annotated[float, Field(ge=0, le=1_000_000, strict=True)]


class _PriceTable(BaseModel):
    """A model's price: ``{ input = 2.50, output = 10.00 }`` per million tokens."""

    model_config = ConfigDict(extra="forbid")

    input: PerMillion
    output: PerMillion


class _BackendTable(BaseModel):
    """One ``[backends.NAME]`` table."""

    model_config = ConfigDict(extra="forbid")

    base_url: NonEmpty
    api_key_env: NonEmpty | None = None
    timeout_s: Seconds = DEFAULT_TIMEOUT_S
    connect_timeout_s: Seconds = DEFAULT_CONNECT_TIMEOUT_S
    models: list[NonEmpty] = []
    aliases: dict[NonEmpty, NonEmpty] = {}
    # Per model name as sent to this backend (exact, or a glob): usage cost and cost budgets.
    prices: dict[NonEmpty, _PriceTable] = {}
    # Whether a stream is asked for its usage (stream_options.include_usage); false for a
    # backend that refuses stream_options (older Azure OpenAI deployments).
    stream_usage: StrictBool = True
    # The role the memory section is sent in: `developer` or `user` for models that refuse
    # `system` (o1-class).
    memory_role: Literal["system", "developer", "user"] = "system"
    # What it serves of /v1/responses: the Responses API (forwarded as is) or, with "chat",
    # chat completions only (text turns translated).
    api: Literal["responses", "chat"] = "responses"


class _FallbackTable(BaseModel):
    """A fallback entry that names the model to send: ``{backend = "…", model = "…"}``."""

    model_config = ConfigDict(extra="forbid")

    backend: NonEmpty
    model: NonEmpty


class BackendsFileError(ConfigError):
    """The backends file cannot be used: one line per mistake, each naming the file."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def is_glob(name: str) -> bool:
    return not _GLOB_CHARS.isdisjoint(name)


@dataclass(frozen=True)
class BackendSpec:
    """One backend, as the file says (its key read from the environment)."""

    name: str
    base_url: str
    api_key_env: str | None = None
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    # Exact names, in file order.
    models: tuple[str, ...] = ()
    globs: tuple[str, ...] = ()
    # Asked name -> the name sent upstream, in file order.
    aliases: Mapping[str, str] = field(default_factory=dict)
    # Model name as sent (or glob) -> its price, in file order.
    prices: Mapping[str, Price] = field(default_factory=dict)
    # False: its streams are sent without the gateway's stream_options (usage estimated).
    stream_usage: bool = True
    # The role of the memory section sent to it (gateway_http.messages.SECTION_ROLES).
    memory_role: str = "system"
    # "responses" or "chat" (gateway_http.upstream.client.RESPONSES_API, CHAT_API).
    api: str = RESPONSES_API

    def price(self, model: str) -> Price | None:
        """The price of ``model`` (as sent to this backend): its own, else the first glob's."""
        price = self.prices.get(model)
        if price is not None:
            return price
        for pattern, each in self.prices.items():
            if is_glob(pattern) and fnmatch.fnmatchcase(model, pattern):
                return each
        return None

    def by_name(self, model: str) -> bool:
        """Whether it lists ``model`` by exact name or as an alias."""
        return model in self.aliases or model in self.models

    def by_glob(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.globs)

    def serves(self, model: str) -> bool:
        return self.by_name(model) or self.by_glob(model)

    def sent_as(self, model: str) -> str | None:
        """The name sent upstream for ``model`` when an alias rewrites it; None: as asked."""
        return self.aliases.get(model)

    @property
    def listed(self) -> tuple[str, ...]:
        """Every name it can be asked for by name: its exact models, then its aliases."""
        return (*self.models, *self.aliases)


@dataclass(frozen=True)
class FallbackTarget:
    backend: str
    # The name sent; None: the model as that backend serves the asked name.
    model: str | None = None


@dataclass(frozen=True)
class FallbackRule:
    # A model name as clients ask for it, or a glob.
    pattern: str
    targets: tuple[FallbackTarget, ...]

    def matches(self, model: str) -> bool:
        if is_glob(self.pattern):
            return fnmatch.fnmatchcase(model, self.pattern)
        return model == self.pattern


@dataclass(frozen=True)
class BackendsFile:
    path: Path
    backends: tuple[BackendSpec, ...]
    fallbacks: tuple[FallbackRule, ...] = ()

    def backend(self, name: str) -> BackendSpec | None:
        for spec in self.backends:
            if spec.name == name:
                return spec
        return None

    def primary(self, model: str) -> BackendSpec | None:
        """The backend that serves ``model``: by exact name or alias first, then by glob."""
        for spec in self.backends:
            if spec.by_name(model):
                return spec
        for spec in self.backends:
            if spec.by_glob(model):
                return spec
        return None

    def aliased(self) -> dict[str, str]:
        """Each alias and the model it names, as the backend serving the alias (the first
        listing it by name) names it; in file order."""
        aliased: dict[str, str] = {}
        for spec in self.backends:
            for alias, named in spec.aliases.items():
                if alias not in aliased and self.primary(alias) is spec:
                    aliased[alias] = named
        return aliased

    def fallback_rule(self, model: str) -> tuple[FallbackRule | None, str]:
        """The ``[fallbacks]`` entry of ``model``, and the name its entries are to serve: the
        key naming ``model`` exactly; for an alias without one, the entry of the model it
        names (that model's exact key, else its first glob); else the first glob matching."""
        exact = self._exact_rule(model)
        if exact is not None:
            return exact, model
        primary = self.primary(model)
        named = primary.sent_as(model) if primary is not None else None
        if named is not None:
            # One step only: an alias names a model of its own backend, whatever other
            # backends call that name.
            model = named
            exact = self._exact_rule(model)
            if exact is not None:
                return exact, model
        for rule in self.fallbacks:
            if rule.matches(model):
                return rule, model
        return None, model

    def _exact_rule(self, model: str) -> FallbackRule | None:
        for rule in self.fallbacks:
            if rule.pattern == model:
                return rule
        return None

    def chain(self, model: str) -> tuple[tuple[BackendSpec, str | None], ...]:
        """Who is asked for ``model``, in order: its backend, then its fallbacks, each with the
        name sent to it (None: as asked); empty when no backend serves it. A backend asked for
        the same name twice is asked once."""
        primary = self.primary(model)
        if primary is None:
            return ()
        chain = [(primary, primary.sent_as(model))]
        seen = {(primary.name, primary.sent_as(model) or model)}
        rule, serving = self.fallback_rule(model)
        for target in rule.targets if rule is not None else ():
            spec = self.backend(target.backend)
            if spec is None:
                continue
            sent = target.model if target.model is not None else spec.sent_as(serving)
            if sent is None and serving != model:
                # Inherited from the model an alias names: that model, not the alias, is sent.
                sent = serving
            if (spec.name, sent or model) not in seen:
                seen.add((spec.name, sent or model))
                chain.append((spec, sent))
        return tuple(chain)

    def price(self, backend: str, model: str) -> Price | None:
        """What ``model`` costs on ``backend`` (as sent there), if the file prices it."""
        spec = self.backend(backend)
        return spec.price(model) if spec is not None else None

    def listed(self) -> list[tuple[str, BackendSpec]]:
        """The models that can be listed (exact names and aliases; globs cannot be), each with
        the backend that serves it, in file order."""
        seen: set[str] = set()
        listed: list[tuple[str, BackendSpec]] = []
        for spec in self.backends:
            for name in spec.listed:
                if name not in seen:
                    seen.add(name)
                    listed.append((name, spec))
        return listed

    def example_model(self) -> str | None:
        """A model name this file routes, for a hint to show: the first listed one, else a name
        one of the globs matches (None when none can be made)."""
        listed = self.listed()
        if listed:
            return listed[0][0]
        for spec in self.backends:
            for pattern in spec.globs:
                # A class becomes its first character, * nothing, ? an x; checked below.
                name = re.sub(r"\[!?([^\]]?)[^\]]*\]", r"\1", pattern)
                name = name.replace("*", "").replace("?", "x")
                if name and self.primary(name) is spec:
                    return name
        return None

    @property
    def secret_values(self) -> tuple[str, ...]:
        """The backends' keys, for the log formatters' backstop."""
        return tuple(spec.api_key for spec in self.backends if spec.api_key)


def load_backends(path: Path, env: Mapping[str, str]) -> BackendsFile:
    """Read and check the backends file at ``path``; keys come from ``env``.

    Every mistake found is one line of the :class:`BackendsFileError` raised.
    """
    where = str(path)
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        raise BackendsFileError(
            [
                f"{where}: the backends file is TOML (a {path.suffix} file is not read); "
                "docs/backends.md shows a LiteLLM config.yaml's parts in TOML"
            ]
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BackendsFileError([f"{where}: cannot read it: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError:
        raise BackendsFileError([f"{where}: not UTF-8 text"]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BackendsFileError([f"{where}: not valid TOML: {exc}"]) from None
    checker = _Checker(env)
    backends_file = checker.check(path, data)
    if checker.problems:
        raise BackendsFileError([f"{where}: {problem}" for problem in checker.problems])
    return backends_file


def _key(name: str) -> str:
    """``name`` as a TOML key in an error line: bare when it can be, else quoted."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


_BACKEND_SETTINGS = ", ".join(_BackendTable.model_fields)


class _Checker:
    """Collects every mistake of one file while building its :class:`BackendsFile`."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env
        self.problems: list[str] = []
        # Backends with mistakes of their own: what refers to them is not blamed as well.
        self._broken: set[str] = set()
        # Every backend the file declares, in order (broken ones too).
        self._declared: list[str] = []

    def check(self, path: Path, data: dict[str, Any]) -> BackendsFile:
        for section in data:
            if section not in _SECTIONS:
                self.problems.append(
                    f"{_key(section)}: unknown section (the file has [backends.NAME] tables "
                    "and a [fallbacks] table)"
                )
        backends = BackendsFile(path, tuple(self._backends(data.get("backends"))))
        fallbacks = self._fallbacks(data.get("fallbacks", {}), backends)
        return BackendsFile(path, backends.backends, tuple(fallbacks))

    def _backends(self, tables: Any) -> list[BackendSpec]:
        if tables is None:
            self.problems.append("backends: no backend: add a [backends.NAME] table")
            return []
        if not isinstance(tables, dict) or not tables:
            self.problems.append("backends: must hold one [backends.NAME] table per backend")
            return []
        specs: list[BackendSpec] = []
        self._declared = list(tables)
        for name, table in tables.items():
            spec = self._backend(name, table)
            if spec is not None:
                specs.append(spec)
            else:
                self._broken.add(name)
        return specs

    def _backend(self, name: str, table: Any) -> BackendSpec | None:
        at = f"backends.{_key(name)}"
        ok = True
        if not _NAME.fullmatch(name):
            self.problems.append(
                f"{at}: a backend's name is up to 64 letters, digits, '-' and '_', starting with "
                "a letter or digit (it is sent in the X-Arona-Backend header)"
            )
            ok = False
        if not isinstance(table, dict):
            self.problems.append(f"{at}: must be a table ([{at}])")
            return None
        try:
            fields = _BackendTable.model_validate(table).model_dump()
        except PydanticValidationError as exc:
            self.problems.extend(_schema_problems(at, exc, f"a backend has {_BACKEND_SETTINGS}"))
            # The settings that passed are checked further all the same: every mistake is
            # reported at once.
            refused = {error["loc"][0] for error in exc.errors()}
            fields = {
                key: value
                for key, value in table.items()
                if key in _BackendTable.model_fields and key not in refused
            }
            ok = False
        base_url = fields.get("base_url")
        if base_url is not None and not valid_base_url(base_url):
            self.problems.append(f"{at}.base_url: must be an http:// or https:// URL with a host")
            ok = False
        elif base_url is not None and URL(base_url).user is not None:
            self.problems.append(
                f"{at}.base_url: must not carry credentials: put the key in an environment "
                "variable and name it in api_key_env"
            )
            ok = False
        api_key_env = fields.get("api_key_env")
        api_key = self._api_key(at, api_key_env)
        if api_key_env is not None and api_key is None:
            ok = False
        models: list[str] = []
        globs: list[str] = []
        for i, model in enumerate(fields.get("models", ())):
            if model in models or model in globs:
                self.problems.append(f"{at}.models[{i}]: {model!r} is listed twice")
                ok = False
            elif is_glob(model):
                globs.append(model)
            else:
                models.append(model)
        aliases: dict[str, str] = fields.get("aliases", {})
        for alias in aliases:
            if is_glob(alias):
                self.problems.append(
                    f"{at}.aliases.{_key(alias)}: an alias is a name, not a glob (no * ? [)"
                )
                ok = False
            elif alias in models:
                self.problems.append(
                    f"{at}.aliases.{_key(alias)}: {alias!r} is also in models: one or the other"
                )
                ok = False
        if not table.get("models") and not table.get("aliases"):
            self.problems.append(f"{at}: serves no model: give it models, aliases or both")
            ok = False
        if not ok or base_url is None:
            return None
        return BackendSpec(
            name=name,
            base_url=base_url,
            api_key_env=api_key_env,
            api_key=api_key,
            timeout_s=float(fields["timeout_s"]),
            connect_timeout_s=float(fields["connect_timeout_s"]),
            models=tuple(models),
            globs=tuple(globs),
            aliases=dict(aliases),
            prices={
                model: Price(price["input"], price["output"])
                for model, price in fields.get("prices", {}).items()
            },
            stream_usage=bool(fields.get("stream_usage", True)),
            memory_role=fields.get("memory_role", "system"),
            api=fields.get("api", RESPONSES_API),
        )

    def _api_key(self, at: str, variable: str | None) -> str | None:
        if variable is None:
            return None
        if not _ENV_NAME.fullmatch(variable):
            # Not echoed: it may be the key itself.
            self.problems.append(
                f"{at}.api_key_env: must be the name of an environment variable (letters, "
                "digits, '_'), not the key; the value is not shown"
            )
            return None
        key = self._env.get(variable, "").strip()
        if not key:
            shown = variable if _SHOWN_ENV_NAME.fullmatch(variable) else "(name not shown)"
            self.problems.append(
                f"{at}.api_key_env: the environment variable {shown} is not set or empty"
            )
            return None
        return key

    def _fallbacks(self, tables: Any, backends: BackendsFile) -> list[FallbackRule]:
        if not isinstance(tables, dict):
            self.problems.append(
                "fallbacks: must be a table of model = [backend, ...] ([fallbacks])"
            )
            return []
        aliased = backends.aliased()
        named = set(aliased.values())
        # The names a glob key is looked up for: every model served by name or by glob, and
        # the models aliases name (an alias has its model's fallbacks)...
        names = [model for spec in backends.backends for model in spec.models]
        names += [literal(model) for model in named]
        served = [*names, *(pattern for spec in backends.backends for pattern in spec.globs)]
        # ... less those an exact key takes, and aliases (unless another alias names them).
        taken = [key for key in tables if not is_glob(key)]
        taken += [alias for alias in aliased if alias not in named]
        rules: list[FallbackRule] = []
        for model, entries in tables.items():
            at = f"fallbacks.{_key(model)}"
            if not isinstance(entries, list) or not entries:
                self.problems.append(
                    f'{at}: must be a list of backends to try in order, e.g. ["backup"]'
                )
                continue
            exact = not is_glob(model)
            # (With a broken backend, that may be the one meant to serve the key.)
            if not self._broken:
                if exact and backends.primary(model) is None and model not in named:
                    self.problems.append(
                        f"{at}: no backend serves {model!r}: add it to a backend's models or "
                        "aliases"
                    )
                elif not exact and not _serves_some(model, served):
                    self.problems.append(_nothing_matched(at, model, aliased))
            # What reaches this key: not what an earlier glob key takes.
            before = [rule.pattern for rule in rules if is_glob(rule.pattern)]
            targets: list[FallbackTarget] = []
            for i, entry in enumerate(entries):
                target = self._fallback_target(f"{at}[{i}]", entry, backends)
                if target is None:
                    continue
                spec = backends.backend(target.backend)
                if target.model is not None or spec is None:
                    targets.append(target)
                    continue
                if exact:
                    missing = None if spec.serves(model) else model
                else:
                    # What it serves, and what never reaches this key, may be left out.
                    exempt = [*spec.models, *spec.globs, *spec.aliases, *taken, *before]
                    missing = _unserved(model, names, served, exempt)
                if missing is None:
                    targets.append(target)
                    continue
                or_write = f'or write {{ backend = "{target.backend}", model = "…" }}'
                if exact:
                    self.problems.append(
                        f"{at}[{i}]: backend {target.backend!r} does not serve {model!r}: add it "
                        f"to its models or aliases, {or_write}"
                    )
                else:
                    self.problems.append(
                        f"{at}[{i}]: backend {target.backend!r} does not serve {missing!r}, "
                        f"which {model!r} matches: add {model!r} to its models, {or_write}"
                    )
            rules.append(FallbackRule(model, tuple(targets)))
        return rules

    def _fallback_target(
        self, at: str, entry: Any, backends: BackendsFile
    ) -> FallbackTarget | None:
        if isinstance(entry, str):
            target = FallbackTarget(entry)
        elif isinstance(entry, dict):
            try:
                parsed = _FallbackTable.model_validate(entry)
            except PydanticValidationError as exc:
                self.problems.extend(_schema_problems(at, exc, "a fallback has backend, model"))
                return None
            target = FallbackTarget(parsed.backend, parsed.model)
        else:
            self.problems.append(
                f'{at}: must be a backend\'s name or {{ backend = "…", model = "…" }}'
            )
            return None
        if target.backend in self._broken:
            return None
        if backends.backend(target.backend) is None:
            known = ", ".join(self._declared) or "none"
            self.problems.append(f"{at}: no backend named {target.backend!r} (backends: {known})")
            return None
        return target


# Any name but the empty one: what a model can be called.
_A_NAME = "?*"


def _serves_some(key: str, served: list[str]) -> bool:
    """Whether some model ``key`` matches is served (yes when the globs are too intricate to
    tell: a file is not refused on a guess)."""
    try:
        return example([[key], served, [_A_NAME]]) is not None
    except Undecided:
        return True


def _unserved(key: str, names: list[str], served: list[str], exempt: list[str]) -> str | None:
    """A model ``key`` matches, served, and not ``exempt``: a name of the file if one is, else
    the shortest; None when there is none (or when it cannot be told)."""
    try:
        return example([[key], names], exempt) or example([[key], served, [_A_NAME]], exempt)
    except Undecided:
        return None


def _nothing_matched(at: str, key: str, aliased: Mapping[str, str]) -> str:
    """The line for a glob key that matches no model a backend serves."""
    for alias, named in aliased.items():
        if fnmatch.fnmatchcase(alias, key):
            return (
                f"{at}: no backend serves a model {key!r} matches; an alias has the fallbacks "
                f"of the model it names ({alias!r}: {named!r}), so key them by that model"
            )
    return f"{at}: no backend serves a model {key!r} matches: add one to a backend's models"


def _schema_problems(at: str, exc: PydanticValidationError, known: str) -> list[str]:
    """One line per schema error, without the value (which may be a secret); ``known`` says
    what settings the table has, for an unknown one."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        loc = "".join(_loc_part(part) for part in error["loc"])
        kind = error["type"]
        if kind == "extra_forbidden" and str(error["loc"][-1]) in ("api_key", "key", "token"):
            message = (
                "keys never go in this file: put the key in an environment variable and name "
                "the variable in api_key_env"
            )
        elif "prices" in error["loc"] and kind in ("extra_forbidden", "model_type"):
            message = "a price is { input = N, output = N }, each per million tokens" + (
                " (no other setting)" if kind == "extra_forbidden" else ""
            )
        elif kind == "extra_forbidden":
            message = f"unknown setting ({known})"
        elif kind == "missing":
            message = "missing (it is required)"
        else:
            message = error["msg"]
        problems.append(f"{at}{loc}: {message}")
    return problems


def _loc_part(part: str | int) -> str:
    if isinstance(part, int):
        return f"[{part}]"
    if part == "[key]":
        return " (the name)"
    return f".{_key(part)}"
