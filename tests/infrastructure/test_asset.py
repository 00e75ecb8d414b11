"""The Lambda asset: every handler the stack names imports from it alone, in a clean interpreter.

The deployed asset targets the runtime's Python (3.14) on arm64, whose compiled wheels this machine's 3.11 cannot
load. So the import test runs against a twin built by the same recipe for the local Python and machine (same pinned
requirements, same code), and a second test checks that the deployed asset differs from the twin only in
what it must: the same distributions at the same versions and the same code, with every compiled module
built for the runtime's Python and architecture.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from packaging.requirements import Requirement

from infra import bundle

if TYPE_CHECKING:
    from tests.infrastructure.conftest import Synth

LAMBDA_UNZIPPED_LIMIT = 250 * 1024 * 1024
LOCAL_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture(scope="module")
def deploy_asset() -> Path:
    return bundle.build_asset()


@pytest.fixture(scope="module")
def twin_asset() -> Path:
    return bundle.build_asset(LOCAL_PYTHON, machine=bundle.HOST_MACHINE)


def handlers(synth: Synth) -> list[str]:
    return sorted(f["Properties"]["Handler"] for f in synth.of_type("AWS::Lambda::Function").values())


def test_every_handler_imports_from_the_asset_in_a_clean_interpreter(
    synth: Synth, twin_asset: Path, tmp_path: Path
) -> None:
    # Given the handlers the stack deploys and an interpreter that sees only the standard library
    # (-I: no user site or PYTHON* variables, -S: no site-packages, -B: leaves the asset as built)
    script = (
        textwrap.dedent(
            """
        import importlib, json, sys
        assert not [p for p in sys.path if "site-packages" in p], sys.path
        sys.path.insert(0, ASSET)
        for handler in HANDLERS:
            module, _, attr = handler.rpartition(".")
            assert callable(getattr(importlib.import_module(module), attr)), handler
        files = {name: getattr(m, "__file__", None) for name, m in sorted(sys.modules.items())}
        print(json.dumps(files))
        """
        )
        .replace("ASSET", repr(str(twin_asset)))
        .replace("HANDLERS", repr(handlers(synth)))
    )
    # When it imports each handler module with the asset as its only addition to sys.path
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-B", "-c", script],
        cwd=tmp_path,
        env={"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Then every import succeeds
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    # And everything that is not the standard library came from the asset
    stdlib = Path(sys.base_prefix).resolve()
    for name, file in loaded.items():
        if file:
            path = Path(file).resolve()
            assert path.is_relative_to(twin_asset.resolve()) or path.is_relative_to(stdlib), (name, file)
    assert {"functions.tick", "functions.ingest", "numpy", "pynamodb", "aws_lambda_powertools"} <= set(loaded)


ELF_MACHINES = {"x86_64": 62, "aarch64": 183}  # an ELF file's e_machine


def elf_machines(asset: Path) -> dict[str, int]:
    """Every ELF file (extension module or bundled shared library) of `asset`, by path: the machine it is built for."""
    found = {}
    for path in asset.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with path.open("rb") as f:
                head = f.read(20)
            if head[:4] == b"\x7fELF":
                found[path.relative_to(asset).as_posix()] = int.from_bytes(head[18:20], "little")
    return found


def distributions(asset: Path) -> set[str]:
    return {p.name.removesuffix(".dist-info") for p in asset.glob("*.dist-info")}


def code_files(asset: Path) -> dict[str, bytes]:
    return {
        p.relative_to(asset).as_posix(): p.read_bytes()
        for package in bundle.SOURCE_PACKAGES
        for p in sorted((asset / package).rglob("*"))
        if p.is_file()
    }


def test_deployed_asset_is_the_twin_built_for_the_runtimes_python(deploy_asset: Path, twin_asset: Path) -> None:
    # Given the asset that is deployed and the twin the import test used
    # Then both hold the same distributions at the same versions, and the same code
    assert distributions(deploy_asset) == distributions(twin_asset)
    assert code_files(deploy_asset) == code_files(twin_asset)
    assert code_files(deploy_asset) == {
        p.relative_to(bundle.REPO).as_posix(): p.read_bytes() for p in bundle.source_files(bundle.REPO)
    }
    # And every compiled module of the deployed asset is built for the runtime's Python (or its stable ABI)
    tag = bundle.LAMBDA_PYTHON.replace(".", "")
    wrong = [
        p.name
        for p in deploy_asset.rglob("*.so")
        if re.search(r"\.cpython-\d+", p.name) and f".cpython-{tag}-{bundle.LAMBDA_MACHINE}-linux-gnu.so" not in p.name
    ]
    assert not wrong, wrong
    assert any(f".cpython-{tag}-{bundle.LAMBDA_MACHINE}-linux-gnu.so" in p.name for p in deploy_asset.rglob("*.so"))
    # And for the runtime's architecture: every ELF file, extension modules and the libraries wheels bundle alike
    deployed, twin = elf_machines(deploy_asset), elf_machines(twin_asset)
    assert deployed and set(deployed.values()) == {ELF_MACHINES[bundle.LAMBDA_MACHINE]}, deployed
    assert twin and set(twin.values()) == {ELF_MACHINES[bundle.HOST_MACHINE]}, twin
    # And no byte code of the build interpreter, nor torch, is shipped
    assert not list(deploy_asset.rglob("__pycache__"))
    assert not (deploy_asset / "torch").exists()
    # And it fits Lambda's limit for an unzipped function
    assert bundle.tree_size(deploy_asset) < LAMBDA_UNZIPPED_LIMIT


def test_the_functions_run_the_python_and_architecture_the_asset_is_built_for(synth: Synth) -> None:
    # Given the functions the stack deploys
    functions = synth.of_type("AWS::Lambda::Function").values()
    # Then each runs the runtime and the architecture the asset's wheels were installed for
    assert {f["Properties"]["Runtime"] for f in functions} == {f"python{bundle.LAMBDA_PYTHON}"}
    assert {tuple(f["Properties"]["Architectures"]) for f in functions} == {(bundle.LAMBDA_ARCHITECTURE,)}
    assert bundle.PLATFORMS == bundle.platforms(bundle.MACHINES[bundle.LAMBDA_ARCHITECTURE])


def test_lambda_requirements_are_pinned_within_the_projects_ranges() -> None:
    # Given the project's declared dependencies and the asset's pinned requirements
    declared = {
        Requirement(r).name.lower(): Requirement(r)
        for r in tomllib.loads((bundle.REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    pins = [
        Requirement(line)
        for line in bundle.REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    # Then each is pinned to one version, inside the range the project (and its tests) accept
    for pin in pins:
        (spec,) = pin.specifier
        assert spec.operator == "==", pin
        assert pin.name.lower() in declared, f"{pin.name} is not a project dependency"
        assert declared[pin.name.lower()].specifier.contains(spec.version), (pin, declared[pin.name.lower()])
    # And the functions' imports are all there; torch never is
    names = {p.name.lower() for p in pins}
    assert {"numpy", "safetensors", "pynamodb", "aws-lambda-powertools", "pydantic", "cryptography"} <= names
    assert "torch" not in names


def test_asset_cache_is_keyed_by_requirements_and_code(tmp_path: Path) -> None:
    # Given a requirements file and a copy of the code
    requirements = tmp_path / "req.txt"
    requirements.write_text("numpy==2.4.6\n")
    key = bundle.dependencies_key("3.14", requirements)
    # When the requirements change, the dependencies' key changes; when they do not, it is stable
    assert bundle.dependencies_key("3.14", requirements) == key
    requirements.write_text("numpy==2.4.5\n")
    assert bundle.dependencies_key("3.14", requirements) != key
    assert bundle.dependencies_key("3.13", requirements) != bundle.dependencies_key("3.14", requirements)
    assert bundle.dependencies_key("3.14", requirements, "x86_64") != bundle.dependencies_key("3.14", requirements)
    # And the asset key follows the code
    repo = tmp_path / "repo"
    for package in bundle.SOURCE_PACKAGES:
        (repo / package).mkdir(parents=True)
        (repo / package / "__init__.py").write_text("")
    before = bundle.source_key(repo)
    (repo / "shared" / "x.py").write_text("X = 1\n")
    assert bundle.source_key(repo) != before
