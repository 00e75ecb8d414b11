"""A participant that is a node of several local devices: one update, N ranks.

Started as `fed-participant start --gpus N`, rank 0 is the daemon and starts ranks 1..N-1 as processes of its own
(`python -m participant.node`). Started under `torchrun --nproc-per-node N` (`--no-python fed-participant start
...`), every rank runs the command: rank 0 is the daemon, and the others (`launched()`) become followers before
anything else, so that they never redeem an invite, join or heartbeat. Either way rank 0 alone speaks to the
coordinator, downloads the global model and uploads the node's update, and the ranks form one torch.distributed
process group (NCCL on CUDA, rank r on cuda:r; gloo on a CPU, which is how a node is tested without a GPU).

Rank 0 hands the followers their work as JSON messages through the group's key-value store (`Channel`): first the
task and run config, then each round's job (the cached global model's path, the round's sample indices, its seed,
how to spread the model), then None at the end. A follower waits for the next message as long as it takes, which a
collective could not: the time between two rounds has no bound. Every rank loads the same global model and runs the
task's own training, in which `participant.task.local_batches` gives rank r its slice `batch[r::N]` of every batch:

- `ddp`: every rank holds the whole model, wrapped in DistributedDataParallel, which averages the gradients;
- `fsdp`: parameters, gradients and optimizer state are sharded across the ranks (`torch.distributed.fsdp
  .fully_shard`, each block of the model's top-level ModuleLists a unit), for a model whose training does not fit
  one device; the trained weights are gathered to rank 0 one tensor at a time.

`auto` picks fsdp on CUDA where the model's training memory (weights, gradients, AdamW's two moments) passes
FIT_FRACTION of a device, ddp otherwise. Either way the node takes the steps one process would take on the whole
batches (up to float rounding), N times as fast, and its throughput is what it reports.

A rank that dies is a crash of the participant, handled the same way: rank 0 notices (the collective it waits in
fails, or the follower's process has exited), kills the ranks it started and exits 1. Started again (under torchrun:
restarted by its agent, `--max-restarts`), the participant resumes from its journal: nothing uploaded is lost,
nothing half-trained was sent, and a round still open is trained again from its global model with the same seed. A
follower whose rank 0 is gone exits. While training, the daemon's checks that the round is still open wait for the
node's training to end (the ranks are in one collective after another).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from participant.protocol import ParticipantError

log = logging.getLogger("participant")

GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # a collective waiting longer than this fails (a rank hung)
MESSAGE_WAIT = datetime.timedelta(minutes=10)  # a follower's wait for the next message, renewed while rank 0 lives
PARENT_CHECK_SECONDS = 1.0
PARALLEL = ("auto", "ddp", "fsdp")
FIT_FRACTION = 0.6  # auto: fsdp where training's weights, gradients and optimizer state pass this much of a device


class NodeFailed(ParticipantError):
    """The node lost a rank: the participant stops as if it had crashed."""


@dataclass(frozen=True)
class Launch:
    """This process's place in a node `torchrun` started: its rank, the node's size, the agent's store, the
    agent's restart count (each restart's messages have their own keys)."""

    rank: int
    size: int
    host: str
    port: int
    attempt: int

    def channel(self) -> Channel:
        """The node's messages in the agent's store, under this restart's keys."""
        return Channel(tcp_store(self.host, self.port), f"fed/{self.attempt}")


def launched() -> Launch | None:
    """The node torchrun started this process in (its environment); None outside torchrun or for a node of one."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or int(env.get("WORLD_SIZE", "1")) < 2:
        return None
    size = int(env["WORLD_SIZE"])
    if int(env.get("LOCAL_WORLD_SIZE", size)) != size:
        raise ParticipantError(f"torchrun across hosts ({size} ranks, {env.get('LOCAL_WORLD_SIZE')} on this one): a "
                               "participant is one host; start one on each host, each with --nproc-per-node")
    return Launch(int(env["RANK"]), size, env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                  int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))


def tcp_store(host: str, port: int, serve: bool = False) -> Any:
    """The node's key-value store: served by this process (`serve`, rank 0 of a node it starts; port 0 picks a free
    one), or reached (rank 0's, or the store of torchrun's agent)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # (not in torch's __all__)

    return TCPStore(host, port, is_master=serve, wait_for_workers=False, timeout=GROUP_TIMEOUT)


def join_group(device: Any, channel: Channel, rank: int, size: int) -> None:
    """Join the node's process group from `device`, this rank's (NCCL on CUDA, gloo on a CPU), meeting the other
    ranks in the channel's store."""
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore  # type: ignore[attr-defined]

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=size,
                            store=PrefixStore(f"{channel.prefix}/group", channel.store), timeout=GROUP_TIMEOUT)


def rank_device(device: Any, rank: int) -> Any:
    """Rank r's device: cuda:r on a CUDA node, the CPU otherwise."""
    import torch

    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


class Channel:
    """Rank 0's messages to the followers, in order, as JSON under `prefix/N` in the group's store. A message is
    removed once the next but one is sent: by then every follower has read it (it trained that job with rank 0)."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store, self.prefix, self.count = store, prefix, 0

    def send(self, message: dict[str, Any] | None) -> None:
        self.store.set(f"{self.prefix}/{self.count}", json.dumps(message))
        if self.count >= 2:
            self.store.delete_key(f"{self.prefix}/{self.count - 2}")
        self.count += 1

    def receive(self) -> dict[str, Any] | None:
        import torch.distributed as dist

        key = f"{self.prefix}/{self.count}"
        while True:
            try:
                self.store.wait([key], MESSAGE_WAIT)
                break
            except dist.DistStoreError as exc:  # a wait that timed out: wait again; anything else ends the follower
                if "timeout" not in str(exc):
                    raise
        self.count += 1
        message: dict[str, Any] | None = json.loads(self.store.get(key))
        return message


def training_bytes(model: Any) -> int:
    """Memory training `model` takes beyond its activations: weights, and for each trainable parameter its gradient
    and AdamW's two float32 moments."""
    return sum(p.nbytes + (p.nbytes + 8 * p.numel() if p.requires_grad else 0) for p in model.parameters())


def shard(model: Any, device: Any) -> Any:
    """`model` sharded in place across the group (FSDP2): each block of its outermost ModuleLists (a transformer's
    layers) is a unit, and the rest of the model the root's; the shards move to `device`."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    lists: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(f"{outer}.") for outer in lists):
            lists.append(name)
            for block in module:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gathered(model: Any, keep: bool) -> dict[str, Any]:
    """A sharded model's whole weights, on the CPU, gathered one tensor at a time (every rank calls this: each
    tensor is a collective); `keep` False: gathered and dropped (a follower's part)."""
    from torch.distributed.tensor import DTensor

    weights = {}
    for name, tensor in model.state_dict().items():
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            weights[name] = whole.detach().cpu()
    return weights


def train_rank(model: Any, job: dict[str, Any], device: Any, run: Callable[[Any], dict[str, float]],
               keep: bool) -> dict[str, float]:
    """One rank's training of `job`: `model` wrapped as `job["parallel"]` says, and `run` (the task's training)
    with it. With fsdp and `keep` (rank 0, whose `model` the daemon goes on using), a copy is sharded and trained,
    and the gathered weights are loaded back into `model`."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(int(job["seed"]))
    if job["parallel"] != "fsdp":
        return node_mean(run(DistributedDataParallel(model.to(device))), device)
    sharded = shard(copy.deepcopy(model.cpu()) if keep else model, device)
    metrics = node_mean(run(sharded), device)
    weights = gathered(sharded, keep)
    if keep:
        model.load_state_dict(weights)
    return metrics


def node_mean(metrics: dict[str, float], device: Any) -> dict[str, float]:
    """The ranks' training metrics averaged (a collective): each rank saw its slice of every batch, so the node's
    loss is their mean, not rank 0's alone."""
    import torch
    import torch.distributed as dist

    names = sorted(metrics)
    values = torch.tensor([float(metrics[name]) for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return dict(zip(names, (values / dist.get_world_size()).tolist(), strict=True))


class Node:
    """Rank 0's handle on the node: starts the followers (or, under torchrun, finds them), hands them each round's
    job, and stops them at the end."""

    def __init__(self, size: int, spec: str, config_json: str, device: Any, threads: int,
                 data: str | None = None, parallel: str = "auto") -> None:
        if size < 2:
            raise ValueError(f"a node has at least 2 ranks, not {size}")
        if parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}, not {parallel!r}")
        self.launch = launched()  # (the command line made its size the node's: participant.cli)
        self.size, self.spec, self.config_json, self.device = size, spec, config_json, device
        self.threads, self.data, self.parallel = threads, data, parallel
        self.followers: list[subprocess.Popen[bytes]] = []
        self.channel: Channel | None = None
        self.log_dir: Path | None = None

    def start(self) -> None:
        """Start ranks 1..N-1 (or reach those torchrun started), send them the setup and form the process group
        (blocks until every rank is in)."""
        import torch.distributed as dist

        if self.launch is not None:
            self.channel = self.launch.channel()
        else:
            store = tcp_store("127.0.0.1", 0, serve=True)
            self._spawn(f"127.0.0.1:{store.port}")
            self.channel = Channel(store, "fed")
        self.channel.send({"spec": self.spec, "config": self.config_json, "device": self.device.type,
                           "threads": self.threads, "data": self.data})
        join_group(rank_device(self.device, 0), self.channel, 0, self.size)
        log.info("node of %d ranks (%s%s) up", self.size, dist.get_backend(), ", torchrun" if self.launch else "")

    def _spawn(self, store: str) -> None:
        for rank in range(1, self.size):
            args = [sys.executable, "-m", "participant.node", "--rank", str(rank), "--size", str(self.size),
                    "--store", store, "--parent", str(os.getpid())]
            out = open(self.log_dir / f"rank{rank}.log", "ab") if self.log_dir else subprocess.DEVNULL  # noqa: SIM115
            self.followers.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT))

    def lost_rank(self) -> bool:
        return any(p.poll() is not None for p in self.followers)

    def stop(self) -> None:
        """At the daemon's end: tell the followers to exit, wait for them and leave the process group (killed, and
        the group left as it is, where a rank is already gone)."""
        import torch.distributed as dist

        if self.channel is None:
            if self.launch is not None:  # torchrun's followers wait for their setup: none is coming
                self.launch.channel().send(None)
            return
        if self.lost_rank():
            self.kill()
            return
        self.channel.send(None)
        try:
            for p in self.followers:
                p.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
            return
        self.followers, self.channel = [], None
        dist.destroy_process_group()

    def kill(self) -> None:
        """Kill the followers at once (the process group is left as it is: this process is about to exit)."""
        for p in self.followers:
            p.kill()
            p.wait()
        self.followers = []

    def parallel_for(self, model: Any) -> str:
        """ddp or fsdp for `model` (see the module's docstring); auto decides once, at the first round."""
        import torch

        if self.parallel != "auto":
            return self.parallel
        if self.device.type != "cuda":
            return "ddp"
        need = training_bytes(model)
        room = min(torch.cuda.get_device_properties(rank).total_memory for rank in range(self.size))
        self.parallel = "fsdp" if need > FIT_FRACTION * room else "ddp"
        log.info("node: %s (training needs %.1f GB beyond activations; a device has %.1f GB)", self.parallel,
                 need / 1e9, room / 1e9)
        return self.parallel

    def train(self, job: dict[str, Any], model: Any, run: Callable[[Any], dict[str, float]]) -> dict[str, float]:
        """Train one round on every rank: send `job` to the followers and `run` the task's training with `model`,
        wrapped for the node. A lost rank is a crash of the participant: the ranks it started are killed and
        NodeFailed raised (exit 1; started again, the participant resumes from its journal and trains the round
        again)."""

        if self.channel is None:
            self.start()
        assert self.channel is not None
        job = job | {"parallel": self.parallel_for(model)}
        try:
            if self.lost_rank():
                raise RuntimeError("a follower's process has exited")
            self.channel.send(job)
            return train_rank(model, job, rank_device(self.device, 0), run, keep=True)
        except BaseException as exc:  # the followers are mid-collective: none may outlive this
            lost = self.lost_rank() or (self.launch is not None and _collective_failed(exc))
            self.kill()
            if lost:
                raise NodeFailed(f"round {job.get('round')}: the node lost a rank ({str(exc).splitlines()[0][:160]}); "
                                 "a crash of the participant: start it again to resume") from None
            raise


def _collective_failed(exc: BaseException) -> bool:
    """A collective failed because a rank is gone: NCCL's DistError, gloo's RuntimeError naming gloo."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


# --- a follower (ranks 1..N-1) ------------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """Exit when rank 0 is gone (its process group alone would only notice at the next collective)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(PARENT_CHECK_SECONDS)


def follow(rank: int, size: int, channel: Channel) -> int:
    """Wait for rank 0's setup, join the process group, then train each job rank 0 sends until it sends None."""
    import torch
    import torch.distributed as dist

    from participant.task import load_task, mixed_precision
    from participant.tensors import load_into
    from shared.config import RunConfig

    setup = channel.receive()
    if setup is None:  # rank 0 ended without training
        return 0
    config = RunConfig.model_validate_json(setup["config"])
    if setup["threads"] > 0:
        torch.set_num_threads(setup["threads"])
    task: Any = load_task(setup["spec"], config)
    if setup["data"]:  # local data mode: this host's own data, as rank 0 loaded it
        task.local_data(setup["data"])
    device = rank_device(torch.device(setup["device"]), rank)
    join_group(device, channel, rank, size)
    while (job := channel.receive()) is not None:
        round_config = RunConfig.model_validate_json(job["config"])
        model = load_into(task.build_model(round_config.seed), Path(job["model"]))
        extra = {"round_no": job["round"]} if job.get("takes_round") else {}
        run = functools.partial(_train_task, task, job["indices"], round_config, device, int(job["seed"]), extra)
        with mixed_precision(device):
            train_rank(model, job, device, run, keep=False)
    dist.destroy_process_group()
    return 0


def _train_task(task: Any, indices: list[int], config: Any, device: Any, seed: int, extra: dict[str, Any],
                model: Any) -> dict[str, float]:
    return dict(task.train(model, indices, config, device, None, seed=seed, **extra))


def follow_launched(launch: Launch) -> int:
    """A follower torchrun started (`fed-participant start` on a rank > 0)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {launch.rank} %(levelname)s %(message)s")
    return follow(launch.rank, launch.size, launch.channel())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m participant.node", description="a follower rank of a node "
                                     "(started by fed-participant start --gpus N; see participant/node.py)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store", required=True, metavar="HOST:PORT")
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    threading.Thread(target=_watch_parent, args=(args.parent,), daemon=True).start()
    host, port = args.store.rsplit(":", 1)
    return follow(args.rank, args.size, Channel(tcp_store(host, int(port)), "fed"))


if __name__ == "__main__":
    sys.exit(main())
