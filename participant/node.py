"""A participant that is a node of several local devices (`fed-participant start --gpus N`): one update, N ranks.

Rank 0 is the daemon: it alone speaks to the coordinator, downloads the global model and uploads the node's update.
It starts ranks 1..N-1 as processes of its own (`python -m participant.node`), joined in a torch.distributed
process group (NCCL on CUDA, rank r on cuda:r; gloo on a CPU, which is how a node is tested on a machine without a
GPU). For each round it sends the followers the job (the cached global model's path, the round's sample indices,
its seed and settings); every rank loads the same global model, wraps it in DistributedDataParallel and runs the
task's own training, in which `participant.task.local_batches` gives each rank its slice `batch[rank::N]` of every
batch. DDP averages the gradients, so the node takes the same steps as one process training the whole batches (up to
float rounding), N times as fast. The node's throughput is what it reports, so throughput sizing sees the node.

A rank that dies is a crash of the participant, handled the same way: rank 0 notices (the collective it waits in
fails), kills the other ranks and exits 1. Started again, the participant resumes from its journal: nothing uploaded
is lost, nothing half-trained was sent, and a round still open is trained again from its global model with the same
seed. A follower whose rank 0 is gone exits. While training, the daemon's checks that the round is still open wait
for the node's training to end (the ranks are in one collective after another); stopping rank 0 (SIGTERM, Ctrl-C)
kills the followers.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from participant.protocol import ParticipantError

log = logging.getLogger("participant")

GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # a collective waiting longer than this fails (a rank hung)
PARENT_CHECK_SECONDS = 1.0


class NodeFailed(ParticipantError):
    """The node lost a rank: the participant stops as if it had crashed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(device: Any, rank: int) -> Any:
    """Rank r's device: cuda:r on a CUDA node, the CPU otherwise."""
    import torch

    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


class Node:
    """Rank 0's handle on the node: starts the followers, hands them each round's job, restarts them when one dies."""

    def __init__(self, size: int, spec: str, config_json: str, device: Any, threads: int,
                 data: str | None = None) -> None:
        if size < 2:
            raise ValueError(f"a node has at least 2 ranks, not {size}")
        self.size, self.spec, self.config_json, self.device = size, spec, config_json, device
        self.threads, self.data = threads, data
        self.followers: list[subprocess.Popen[bytes]] = []
        self.log_dir: Path | None = None

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def start(self) -> None:
        """Start ranks 1..N-1 and join them in a process group (blocks until every rank is in)."""
        import torch.distributed as dist

        init = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(1, self.size):
            args = [sys.executable, "-m", "participant.node", "--rank", str(rank), "--size", str(self.size),
                    "--init", init, "--task", self.spec, "--config-json", self.config_json, "--device",
                    str(self.device.type), "--threads", str(self.threads), "--parent", str(os.getpid())]
            if self.data:
                args += ["--data", self.data]
            out = open(self.log_dir / f"rank{rank}.log", "ab") if self.log_dir else subprocess.DEVNULL  # noqa: SIM115
            self.followers.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT))
        dist.init_process_group(self.backend, init_method=init, rank=0, world_size=self.size, timeout=GROUP_TIMEOUT)
        log.info("node of %d ranks (%s) up", self.size, self.backend)

    def lost_rank(self) -> bool:
        return any(p.poll() is not None for p in self.followers)

    def stop(self) -> None:
        """At the daemon's end: tell the followers to exit, wait for them and leave the process group (killed, and
        the group left as it is, where a rank is already gone)."""
        import torch.distributed as dist

        if not self.followers:
            return
        if self.lost_rank():
            self.kill()
            return
        try:
            dist.broadcast_object_list([None], src=0)
            for p in self.followers:
                p.wait(30)
        except (RuntimeError, subprocess.TimeoutExpired):
            self.kill()
            return
        self.followers = []
        dist.destroy_process_group()

    def kill(self) -> None:
        """Kill the followers at once (the process group is left as it is: this process is about to exit)."""
        for p in self.followers:
            p.kill()
            p.wait()
        self.followers = []

    def train(self, job: dict[str, Any], model: Any, run: Callable[[Any], dict[str, float]]) -> dict[str, float]:
        """Train one round on every rank: send `job` to the followers, wrap `model` in DDP and `run` the task's
        training with it. A lost rank is a crash of the participant: the other ranks are killed and NodeFailed
        raised (exit 1; started again, the participant resumes from its journal and trains the round again)."""
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not self.followers:
            self.start()
        try:
            dist.broadcast_object_list([job], src=0)
            torch.manual_seed(int(job["seed"]))
            return run(DistributedDataParallel(model.to(rank_device(self.device, 0))))
        except BaseException as exc:  # the followers are mid-collective: none may outlive this
            lost = self.lost_rank()
            self.kill()
            if lost:
                raise NodeFailed(f"round {job.get('round')}: the node lost a rank ({str(exc).splitlines()[0][:160]}); "
                                 "a crash of the participant: start it again to resume") from None
            raise


# --- a follower (ranks 1..N-1) ------------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """Exit when rank 0 is gone (its process group alone would only notice at the next collective)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(PARENT_CHECK_SECONDS)


def follow(rank: int, size: int, init: str, spec: str, config_json: str, device_kind: str, threads: int,
           data: str | None) -> int:
    """Join the process group, then train each job rank 0 sends until it sends None."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from participant.task import load_task
    from participant.tensors import load_into
    from shared.config import RunConfig

    config = RunConfig.model_validate_json(config_json)
    if threads > 0:
        torch.set_num_threads(threads)
    task: Any = load_task(spec, config)
    if data:  # local data mode: this host's own data, as rank 0 loaded it
        task.local_data(data)
    device = rank_device(torch.device(device_kind), rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init, rank=rank,
                            world_size=size, timeout=GROUP_TIMEOUT)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        job = box[0]
        if job is None:
            break
        round_config = RunConfig.model_validate_json(job["config"])
        model = load_into(task.build_model(round_config.seed), Path(job["model"])).to(device)
        torch.manual_seed(int(job["seed"]))
        extra = {"round_no": job["round"]} if job.get("takes_round") else {}
        task.train(DistributedDataParallel(model), job["indices"], round_config, device, None, seed=int(job["seed"]),
                   **extra)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m participant.node", description="a follower rank of a node "
                                     "(started by fed-participant start --gpus N; see participant/node.py)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--data")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    threading.Thread(target=_watch_parent, args=(args.parent,), daemon=True).start()
    return follow(args.rank, args.size, args.init, args.task, args.config_json, args.device, args.threads, args.data)


if __name__ == "__main__":
    sys.exit(main())
