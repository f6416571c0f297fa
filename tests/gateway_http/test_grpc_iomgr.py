"""The gateway runs gRPC on its I/O manager for the releases where that was measured."""

from __future__ import annotations

from importlib import metadata

import pytest

from gateway_http.commands import runtime


def test_the_measured_release_gets_the_io_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metadata, "version", lambda name: "1.85.3")
    env: dict[str, str] = {}
    runtime.prefer_grpc_iomgr(env)
    assert env == {"GRPC_EXPERIMENTS": "-event_engine_client,-event_engine_listener"}


@pytest.mark.parametrize("chosen", ["", "event_engine_client"])
def test_the_users_own_choice_wins(monkeypatch: pytest.MonkeyPatch, chosen: str) -> None:
    monkeypatch.setattr(metadata, "version", lambda name: "1.85.3")
    env = {"GRPC_EXPERIMENTS": chosen}
    runtime.prefer_grpc_iomgr(env)
    assert env == {"GRPC_EXPERIMENTS": chosen}


def test_other_releases_keep_grpcs_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metadata, "version", lambda name: "1.91.0")
    env: dict[str, str] = {}
    runtime.prefer_grpc_iomgr(env)
    assert env == {}

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    runtime.prefer_grpc_iomgr(env)
    assert env == {}


def test_the_installed_release_is_one_that_was_measured() -> None:
    # When grpcio moves on, the choice must be measured again (make bench) before the
    # release is added to GRPC_IOMGR_RELEASES; until then the gateway uses gRPC's defaults.
    assert metadata.version("grpcio").startswith(runtime.GRPC_IOMGR_RELEASES)
