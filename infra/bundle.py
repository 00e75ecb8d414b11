"""Build the coordinator functions' Lambda asset without Docker.

pip installs manylinux wheels for the Lambda runtime's Python and architecture into a directory (never compiling
anything, never running the target interpreter), then the coordinator's code (`SOURCE_PACKAGES`) is copied in
beside them:

    build/lambda/deps-py314-aarch64-<hash of requirements>/   the dependencies, cached: rebuilt only when
                                                               lambda-requirements.txt (or this recipe) changes
    build/lambda/asset-py314-aarch64-<hash of deps + code>/   what Lambda runs: deps (hard links) + the code

Both are built in a temporary directory and renamed into place, so a directory that exists is complete
and two builds racing never see half of one. The tests build a twin by the same recipe for the interpreter and
machine at hand (`build_asset("3.11", machine=HOST_MACHINE)`), which they can import and run.
`python -m infra.bundle [--python 3.11] [--machine x86_64]` builds by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD_ROOT = REPO / "build" / "lambda"
REQUIREMENTS = Path(__file__).resolve().with_name("lambda-requirements.txt")
SOURCE_PACKAGES = ("shared", "store", "coordinator", "functions")

# The Lambda runtime: aws_lambda.Runtime.PYTHON_3_14 on arm64 (Graviton; Amazon Linux 2023, glibc 2.34), about
# 20 % less per GB-second than x86_64; every pinned requirement has a wheel for it (infra/lambdas.py checks that
# the functions' runtime and architecture are these).
LAMBDA_PYTHON = "3.14"
LAMBDA_ARCHITECTURE = "arm64"  # Lambda's name for it
MACHINES = {"arm64": "aarch64", "x86_64": "x86_64"}  # Lambda's architecture -> the machine wheels are tagged for
LAMBDA_MACHINE = MACHINES[LAMBDA_ARCHITECTURE]
HOST_MACHINE = platform.machine()  # this machine's (a twin asset the tests can load here)


def platforms(machine: str) -> tuple[str, ...]:
    """The wheel platforms pip may install for `machine`. Both tags are needed: with manylinux2014 alone pip settles
    for old releases, with 2_28 alone some wheels are missing."""
    return (f"manylinux2014_{machine}", f"manylinux_2_28_{machine}")


PLATFORMS = platforms(LAMBDA_MACHINE)
# Bump when the recipe below changes, so cached directories built by the old recipe are not reused.
RECIPE = "3"
KEEP_ASSETS = 3  # older asset directories are pruned


class BundleError(RuntimeError):
    """The asset could not be built (pip failed, or a wheel is missing for the target platform)."""


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _tag(python_version: str) -> str:
    """ "3.14" -> "314": no dot in directory names (CDK would take ".14-..." for a file extension)."""
    return python_version.replace(".", "")


def _name(python_version: str, machine: str) -> str:
    """ "3.14", "aarch64" -> "py314-aarch64" (what a build directory's name says it holds)."""
    return f"py{_tag(python_version)}-{machine}"


def dependencies_key(
    python_version: str = LAMBDA_PYTHON, requirements: Path = REQUIREMENTS, machine: str = LAMBDA_MACHINE
) -> str:
    return _digest(RECIPE, python_version, *platforms(machine), requirements.read_bytes())


def source_files(repo: Path) -> list[Path]:
    files = []
    for package in SOURCE_PACKAGES:
        root = repo / package
        if not (root / "__init__.py").is_file():
            raise BundleError(f"{root} is not a Python package")
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in {".pyc", ".pyo"}:
                files.append(path)
    return files


def source_key(repo: Path = REPO) -> str:
    parts: list[bytes | str] = []
    for path in source_files(repo):
        parts += [path.relative_to(repo).as_posix(), path.read_bytes()]
    return _digest(*parts)


def _pip_install(target: Path, python_version: str, requirements: Path, machine: str) -> None:
    tags = [arg for tag in platforms(machine) for arg in ("--platform", tag)]
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--target", str(target), "--no-compile", "--only-binary=:all:", "--implementation", "cp",
        "--python-version", python_version, *tags, "-r", str(requirements),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BundleError(
            f"pip could not install the Lambda dependencies for Python {python_version} on {machine}:\n"
            f"{proc.stdout}{proc.stderr}"
        )


def _prune(root: Path) -> None:
    """Drop what the functions never load: console scripts, byte code of the build interpreter, numpy's tests."""
    shutil.rmtree(root / "bin", ignore_errors=True)
    for path in sorted(root.rglob("__pycache__"), reverse=True):
        shutil.rmtree(path, ignore_errors=True)
    for path in sorted((root / "numpy").rglob("tests"), reverse=True):
        if path.is_dir():
            shutil.rmtree(path)


def _install_dir(final: Path, fill) -> Path:  # type: ignore[no-untyped-def]
    """Build into a private temporary directory, then rename it to `final` (atomic; first one wins)."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        fill(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_dependencies(
    python_version: str = LAMBDA_PYTHON,
    *,
    root: Path = BUILD_ROOT,
    requirements: Path = REQUIREMENTS,
    machine: str = LAMBDA_MACHINE,
) -> Path:
    """The dependencies' directory for `python_version` on `machine`, from the cache when its requirements are
    unchanged."""
    final = root / f"deps-{_name(python_version, machine)}-{dependencies_key(python_version, requirements, machine)}"

    def fill(tmp: Path) -> None:
        tmp.mkdir()
        _pip_install(tmp, python_version, requirements, machine)
        _prune(tmp)

    return _install_dir(final, fill)


def asset_key(
    python_version: str = LAMBDA_PYTHON,
    *,
    repo: Path = REPO,
    requirements: Path = REQUIREMENTS,
    machine: str = LAMBDA_MACHINE,
) -> str:
    """Identifies the asset's content: used as the CDK asset hash, so synth never re-hashes 100 MB."""
    return _digest(dependencies_key(python_version, requirements, machine), source_key(repo))


def build_asset(
    python_version: str = LAMBDA_PYTHON,
    *,
    repo: Path = REPO,
    root: Path = BUILD_ROOT,
    requirements: Path = REQUIREMENTS,
    machine: str = LAMBDA_MACHINE,
) -> Path:
    """The directory Lambda runs: dependencies plus `SOURCE_PACKAGES` at its top level (for the runtime's Python
    and machine unless told otherwise)."""
    deps = build_dependencies(python_version, root=root, requirements=requirements, machine=machine)
    key = asset_key(python_version, repo=repo, requirements=requirements, machine=machine)
    final = root / f"asset-{_name(python_version, machine)}-{key}"

    def fill(tmp: Path) -> None:
        shutil.copytree(deps, tmp, copy_function=_link_or_copy)
        for path in source_files(repo):
            dest = tmp / path.relative_to(repo)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)

    asset = _install_dir(final, fill)
    _prune_old_assets(root, _name(python_version, machine), keep=asset)
    return asset


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _prune_old_assets(root: Path, name: str, keep: Path) -> None:
    assets = [p for p in root.glob(f"asset-{name}-*") if p.is_dir() and p != keep]
    assets.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in assets[KEEP_ASSETS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=LAMBDA_PYTHON, help=f"target Python (default {LAMBDA_PYTHON})")
    parser.add_argument(
        "--machine",
        default=LAMBDA_MACHINE,
        choices=sorted(set(MACHINES.values())),
        help=f"target machine (default {LAMBDA_MACHINE}, Lambda's {LAMBDA_ARCHITECTURE})",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        asset = build_asset(args.python, machine=args.machine)
    except BundleError as exc:
        print(exc, file=sys.stderr)
        return 1
    size = tree_size(asset) / 1e6
    print(f"{asset.relative_to(REPO)}  {size:.0f} MB unpacked  ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
