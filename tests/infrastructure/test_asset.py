"""The Lambda asset: every handler the stack names imports from it alone, in a clean interpreter, and a whole round
runs through the four functions, each in a sandbox of its own that sees the asset and the standard library only.

The deployed asset targets the runtime's Python (3.14) on arm64, whose compiled wheels this machine's 3.11 cannot
load. So the import test runs against a twin built by the same recipe for the local Python and machine (same pinned
requirements, same code), and a second test checks that the deployed asset differs from the twin only in
what it must: the same distributions at the same versions and the same code, with every compiled module
built for the runtime's Python and architecture.

The round: moto's server in a process of its own (`local.server.ServerProcess`) with the run's resources
(`local.resources.create_resources`) and a shard queue; tick, ingest, join and shard each in a fresh `-I -S -B`
interpreter (`lambda_sandbox.py`, driven by `sandboxes.Sandbox`) with the environment the stack gives it; the test
plays the schedule, EventBridge, the join queue's event source mapping and two participants. The shard sandbox polls
the shard queue itself, as the shard function's event source mapping does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
import numpy as np
import pytest
from botocore.config import Config
from packaging.requirements import Requirement

from coordinator.deps import build_deps
from infra import bundle
from local import access
from local.resources import LocalResources, create_resources
from local.server import ServerProcess
from shared import keys, wire
from shared.config import RunConfig
from shared.digest import PIECE_BYTES
from shared.naming import shard_queue_name
from shared.selection import assigned_count
from shared.state import Phase, RunState
from tests.infrastructure.sandboxes import (
    DRIVER,
    SECRET,
    Participant,
    Sandbox,
    function_environments,
    function_settings,
    scheduled_tick_event,
    sqs_record,
)

if TYPE_CHECKING:
    from tests.infrastructure.conftest import Synth

LAMBDA_UNZIPPED_LIMIT = 250 * 1024 * 1024
LOCAL_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
REGION = "us-east-1"
MB = 1024 * 1024


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


# --- one round, each function in a sandbox of its own -------------------------------------------------------------


def sandbox_config() -> RunConfig:
    """Two members, a round closed by its second update, shards of one 8 MiB piece (a ~20 MiB model: 3 shards)."""
    return RunConfig(
        run_id="sandbox-run", min_clients=2, min_per_round=2, min_updates=2, total_rounds=2, warmup_time=0,
        max_round_train_time=300, round_witness_time=0, cooldown_time=0, liveness_timeout=600, dataset_size=100,
        max_update_bytes=64 * MB, shard_bytes=PIECE_BYTES,
        task="tests.infrastructure.test_asset:model",  # what the members offer (no built-in task's model)
        strategy="fedavg",  # the global is checked below against FedAvg's weighted mean
    )  # fmt: skip


def model(seed: int) -> dict[str, np.ndarray]:
    """~19.5 MiB of float32 in tensors that do not fall on piece boundaries: three 8 MiB pieces."""
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((1536, 2048), np.float32),
        "head.weight": rng.standard_normal((999, 2048), np.float32),
        "head.bias": rng.standard_normal(999, np.float32),
    }


@pytest.fixture
def local_run(monkeypatch: pytest.MonkeyPatch, synth: Synth) -> Iterator[tuple[RunConfig, LocalResources, str]]:
    """moto's server in a process of its own, the run's resources on it, and the shard queue (as the stack makes it:
    its visibility timeout the shard function's timeout + 30 s)."""
    for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    # The test's own requests (setting up, looking at the state) use a key that names none of the run's principals.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "sandbox-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    config = sandbox_config()
    shard_queue = synth.resources[synth.logical_id(synth.stack.coordinator.shard_queue)]["Properties"]
    with ServerProcess() as server:
        resources = create_resources(config.run_id, server.endpoint, REGION)
        # Every call of the functions (function-<name>) and participants (participant-<id>) is judged against their
        # roles in the synthesized template, as on AWS (`local.access`)
        access.enable_on(server, config, REGION, server.endpoint)
        sqs = boto3.client("sqs", endpoint_url=server.endpoint, region_name=REGION)
        url = resources.shard_queue_url  # (the local stack's: as the template declares it)
        assert url.endswith(shard_queue_name(config.run_id))
        sqs.set_queue_attributes(QueueUrl=url, Attributes={"VisibilityTimeout": str(shard_queue["VisibilityTimeout"])})
        yield config, resources, url


def check_sandbox_path(sandbox: Sandbox) -> list[Path]:
    """The sandbox's sys.path is the asset, then the standard library only; returns the standard library's entries."""
    sys_path = sandbox.wait_ready()["sys_path"]
    assert sys_path[0] == str(sandbox.asset), sys_path
    stdlib = [Path(p).resolve() for p in sys_path[1:]]
    for path in stdlib:
        assert path.is_relative_to(Path(sys.base_prefix).resolve()) and "site-packages" not in path.parts, sys_path
    return stdlib


def check_module_origins(sandbox: Sandbox, stdlib: list[Path]) -> dict[str, str | None]:
    """Every module the sandbox loaded came from the asset (where boto3 is too: lambda-requirements.txt pins it) or
    the standard library; the driver itself is the runtime's bootstrap, as Lambda's lives outside /var/task."""
    loaded = sandbox.modules()
    asset = sandbox.asset.resolve()
    assert loaded.pop("__main__") == str(DRIVER)
    assert loaded.pop("__mp_main__", str(DRIVER)) == str(DRIVER)  # (multiprocessing's name for __main__)
    outside = {}
    for name, file in loaded.items():
        if file:
            path = Path(file).resolve()
            if not (path.is_relative_to(asset) or any(path.is_relative_to(p) for p in stdlib)):
                outside[name] = file
            assert "site-packages" not in path.parts, (name, file)
    assert not outside, f"{sandbox.name} loaded modules from outside the asset: {outside}"
    return loaded


def start_sandboxes(
    stack: ExitStack, synth: Synth, asset: Path, envs: dict[str, dict[str, str]], workdir: Path, shard_queue: str
) -> dict[str, Sandbox]:
    """The four functions' sandboxes, started at once (their cold starts overlap), each closed by `stack`."""
    sandboxes = {}
    for name, (handler, memory, timeout) in function_settings(synth).items():
        sandbox = Sandbox(name, asset, handler, envs[name], workdir, timeout=timeout, memory=memory,
                          queue_url=shard_queue if name == "shard" else "")  # fmt: skip
        stack.callback(sandbox.close)
        sandboxes[name] = sandbox
    return sandboxes


def test_a_round_runs_through_the_functions_each_in_a_sandbox_that_sees_only_the_asset(
    synth: Synth, twin_asset: Path, local_run: tuple[RunConfig, LocalResources, str], tmp_path: Path
) -> None:
    config, res, shard_queue = local_run
    run = config.run_id
    envs = function_environments(synth, config, res, shard_queue, REGION)
    deps = build_deps(run, res.bucket, res.table, config.model_dump_json(), res.endpoint, REGION, res.state_topic)

    def state() -> RunState:
        return deps.store.read_state()

    with ExitStack() as stack:
        # Given the four functions, each in a fresh interpreter that sees the standard library and the asset only
        sandboxes = start_sandboxes(stack, synth, twin_asset, envs, tmp_path, shard_queue)
        tick, ingest, join, shard = (sandboxes[n] for n in ("tick", "ingest", "join", "shard"))
        stdlib = {}
        for name, sandbox in sandboxes.items():
            assert sandbox.wait_ready()["init_error"] is None, sandbox.ready
            stdlib[name] = check_sandbox_path(sandbox)
            assert sandbox.ready["environ"] == sorted(envs[name])  # (nothing else: no PYTHON*, no HOME, no site)
        assert len({s.process.pid for s in sandboxes.values()}) == 4

        def shard_failed() -> str | None:
            failed = [p for p in shard.polled if not p["ok"]]
            if failed or shard.poller_errors or shard.process.poll() is not None:
                return f"the shard function failed: {failed or shard.poller_errors}\n{shard.log_tail()}"
            return None

        # When the schedule ticks a new run
        first = tick.call(scheduled_tick_event())
        assert first["committed"] and first["phase"] == Phase.WAITING, first
        # And two participants upload join requests, which EventBridge routes to the join queue, whose event source
        # mapping hands them to the join function as one batch (read with the join function's role, as it does)
        members = [Participant(pid, res) for pid in ("alice", "bob")]
        for p in members:
            p.put(keys.join_key(run, p.pid), p.join_request(run))
        join_sqs = boto3.client("sqs", endpoint_url=res.endpoint, region_name=REGION,
                                aws_access_key_id="function-join", aws_secret_access_key=SECRET)  # fmt: skip
        join_arn = join_sqs.get_queue_attributes(QueueUrl=res.join_queue_url, AttributeNames=["QueueArn"])
        messages: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while len(messages) < len(members) and time.monotonic() < deadline:
            got = join_sqs.receive_message(QueueUrl=res.join_queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=5,
                                           AttributeNames=["All"])  # fmt: skip
            messages += got.get("Messages", [])
        assert len(messages) == len(members), messages
        batch = {"Records": [sqs_record(m, join_arn["Attributes"]["QueueArn"], REGION) for m in messages]}
        assert join.call(batch) == {"batchItemFailures": []}
        for m in messages:
            join_sqs.delete_message(QueueUrl=res.join_queue_url, ReceiptHandle=m["ReceiptHandle"])
        # And each heartbeats, and the first offers the initial model (each upload's event to ingest)
        for p in members:
            beat = ingest.call(p.put(keys.heartbeat_key(run, p.pid), p.heartbeat()))
            assert beat["accepted"], beat
        offered = ingest.call(members[0].put(keys.init_key(run, "alice"), wire.encode(model(0))))
        assert offered["accepted"], offered
        s = state()
        assert (s.phase, s.round, s.selected) == (Phase.TRAIN, 0, ("alice", "bob")), s
        # And both upload their round-0 update, ~20 MiB each
        sent, samples, outcomes = {}, {}, []
        for i, p in enumerate(members):
            sent[p.pid] = model(i + 1)
            samples[p.pid] = assigned_count(config.dataset_size, s.plan or s.selected, p.pid)
            meta = wire.UpdateMeta(run, 0, p.pid, samples[p.pid], {"loss": 1.0})
            event = p.put(keys.update_key(run, 0, p.pid), wire.encode(sent[p.pid], meta.to_metadata()))
            outcomes.append(ingest.call(event, abort=shard_failed))
        # Then the first update is recorded, without a tick (it cannot close the round), and the second closes the
        # round: its ingest ticks, sends the shard tasks to the shard queue, waits for the shard function's outcomes,
        # and commits round 0's aggregate
        assert all(o["accepted"] for o in outcomes) and "tick" not in outcomes[0], outcomes
        last = outcomes[-1]["tick"]
        assert last["committed"] and last["round"] == 1 and "aggregate_next_round" in last["fired"], last
        s = state()
        assert (s.round, s.aggregated) == (1, 1), s
        # (read as the project's readers read: the global is a copy of a multipart upload, whose stored checksum is
        # of its parts, not of the bytes a GET returns; see tests/functional/test_local_objects.py)
        reader = boto3.client("s3", endpoint_url=res.endpoint, region_name=REGION,
                              config=Config(response_checksum_validation="when_required"))  # fmt: skip
        raw = reader.get_object(Bucket=res.bucket, Key=keys.global_key(run, 1, s.global_digest))["Body"].read()
        assert wire.digest(raw) == s.global_digest
        aggregate, _ = wire.decode(raw)
        total = sum(samples.values())
        for name, base in model(0).items():
            want = sum(sent[p][name].astype(np.float64) * samples[p] for p in sent) / total
            assert aggregate[name].shape == base.shape
            np.testing.assert_allclose(aggregate[name], want, rtol=1e-6, atol=1e-6)
        # And the shard function ran one invocation per shard, each from the queue, each deleted once done
        pieces = -(-len(raw) // PIECE_BYTES)
        assert pieces >= 3
        polled = shard.wait_polled(pieces)
        assert len(polled) == pieces and all(p["ok"] for p in polled), polled
        assert not shard.poller_errors, shard.poller_errors
        left = boto3.client("sqs", endpoint_url=res.endpoint, region_name=REGION).get_queue_attributes(
            QueueUrl=shard_queue,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        assert set(left.values()) == {"0"}, left
        # And every module any of the four loaded came from the asset or the standard library
        for name, sandbox in sandboxes.items():
            loaded = check_module_origins(sandbox, stdlib[name])
            assert f"functions.{name}" in loaded and "boto3" in loaded and "numpy" in loaded


@pytest.mark.parametrize("missing", ["participant", "torch"])
def test_an_import_from_outside_the_asset_fails_the_function(
    synth: Synth, twin_asset: Path, tmp_path: Path, missing: str
) -> None:
    # Given a copy of the asset in which the tick's module imports a module the asset does not hold (one of this
    # repository's packages, or torch: both installed where the tests run)
    asset = tmp_path / "asset"
    shutil.copytree(twin_asset, asset)
    tick = asset / "functions" / "tick.py"
    source = tick.read_text()
    marker = "from __future__ import annotations\n"
    assert marker in source
    tick.write_text(source.replace(marker, f"{marker}\nimport {missing}\n", 1))
    config = sandbox_config()
    nowhere = "http://127.0.0.1:9"  # (the invocation fails before any request)
    resources = LocalResources(
        config.run_id,
        f"fed-{config.run_id}",
        f"fed-{config.run_id}-state",
        "",
        nowhere,
        REGION,
        state_topic=f"arn:aws:sns:{REGION}:123456789012:fed-{config.run_id}-state",
    )
    envs = function_environments(synth, config, resources, f"{nowhere}/123456789012/shards", REGION)
    handler, memory, timeout = function_settings(synth)["tick"]
    with ExitStack() as stack:
        # When the tick's sandbox runs on it, and the schedule invokes it
        sandbox = Sandbox("tick", asset, handler, envs["tick"], tmp_path / "sandboxes", timeout=timeout, memory=memory)
        stack.callback(sandbox.close)
        stdlib = check_sandbox_path(sandbox)
        answer = sandbox.invoke(scheduled_tick_event())
        # Then the invocation fails, naming the import, as Lambda's runtime reports a handler it cannot import
        assert "error" in answer, answer
        error = answer["error"]
        assert error["errorType"] == "Runtime.ImportModuleError", error
        assert error["errorMessage"] == f"Unable to import module 'functions.tick': No module named '{missing}'"
        # And so does every later invocation of the same sandbox
        assert sandbox.invoke(scheduled_tick_event())["error"]["errorMessage"] == error["errorMessage"]
        # And nothing was loaded from outside the asset meanwhile
        check_module_origins(sandbox, stdlib)


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
