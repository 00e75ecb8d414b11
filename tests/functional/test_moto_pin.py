"""The local stack starts only on the moto release its patches were written for."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from local.moto.pin import MOTO_VERSION, MotoVersionMismatch, check_moto
from local.server import LocalServer

ROOT = Path(__file__).resolve().parents[2]


def test_the_pin_in_pyproject_is_the_version_the_stack_checks_for() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["local"]
    assert f"moto[server]=={MOTO_VERSION}" in extras, extras
    check_moto()  # and it is what this environment installed


def test_another_moto_version_stops_the_stack_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MotoVersionMismatch) as raised:
        check_moto("5.1.0")
    message = str(raised.value)
    assert f"moto {MOTO_VERSION}" in message and "moto 5.1.0 is installed" in message
    assert f"pip install 'moto[server]=={MOTO_VERSION}'" in message
    # the server checks before it patches anything
    monkeypatch.setattr("local.moto.pin.version", lambda name: "6.0.0")
    with pytest.raises(MotoVersionMismatch, match="moto 6.0.0 is installed"):
        LocalServer(port=0).start()


def test_fed_local_says_so_and_exits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rich.console import Console

    from fed.localrun import default_local_config, run_local

    monkeypatch.setattr("local.moto.pin.version", lambda name: "5.0.0")
    console = Console(record=True, width=200)
    code = run_local(default_local_config(), 0, 0.5, tmp_path / "connection.json", console=console)
    assert code == 1
    assert "moto 5.0.0 is installed" in console.export_text()
