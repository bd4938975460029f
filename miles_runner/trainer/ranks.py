"""Several trainer ranks (plan.trainer.parallel.world_size > 1): the driver's own process is rank 0, and
world_size - 1 follower processes replay every call rank 0 makes on the trainer (SPMD), so the collectives
inside the trainer (FSDP2 all-gathers, gradient all-reduces, full state-dict gathers) line up on every rank.

Each rank runs where plan.trainer.placements puts it ([node, device]): the driver is on node 0 and starts the
followers of node 0 itself; a follower on another node is started by that node's agent (`RemoteRanks`, from the
Ray executor's deployment), and every rank joins rank 0 at node 0's own address (loopback on one node).

    driver, rank 0                          follower k: python -m miles_runner.trainer.ranks RUN_DIR --rank k ...
    trainer = make_trainer(plan, run_dir)   builds the same trainer from RUN_DIR/plan.yaml
    trainer.train(samples)   ----------->   ("train", samples) -> trainer.train(samples), collectives inside
    trainer.close()          ----------->   ("exit") -> leaves the group and exits

Commands travel as pickled objects over gloo (a group of their own when the trainer's group is NCCL). Every rank
gets the same arguments, so an error raised by a call is raised on every rank: followers log it and wait for
the next command, as rank 0's caller decides. A follower that dies makes rank 0's next collective fail within
`TIMEOUT_S` rather than hang.

Rank 0's trainer is a proxy that implements the same Protocol as the trainer it holds (trainer/interface.py):
`RankedTrainer` a `Trainer`, `RankedMultiLoRATrainer` a `MultiLoRATrainer`. Each of their methods says whether it
is replayed on every rank (it changes trainer state or holds collectives) or is rank 0's alone.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from miles_runner.core.adapters import AdapterSpec
from miles_runner.plan.model import Launch, Plan
from miles_runner.plan.record import read_plan
from miles_runner.plan.render import trainer_rank_launch
from miles_runner.procs.heap import freeze_startup_heap
from miles_runner.procs.launch import launch_process
from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.trainer.fsdp import FSDPTrainer
from miles_runner.trainer.interface import MultiLoRATrainer, Trainer
from miles_runner.trainer.logprobs import TrainingSample
from miles_runner.trainer.multi_lora import MultiLoRASettings, PeftMultiLoRATrainer
from miles_runner.trainer.policy_trainer import TrainerSettings

log = logging.getLogger(__name__)

TIMEOUT_S = 600.0
EXIT = "exit"

T = TypeVar("T")


def build_trainer(plan: Plan) -> Trainer:
    """This rank's trainer of a one-adapter plan: the Megatron trainer for trainer=megatron, else the FSDP
    trainer."""
    _compute_threads(plan)
    if plan.trainer.backend == "megatron":
        from miles_runner.trainer.megatron.trainer import build_megatron_trainer  # megatron imports take seconds

        if plan.trainer.lora_mode == "bridge":  # Megatron-Bridge's model and LoRA (Python 3.12)
            from miles_runner.trainer.megatron.bridge import BridgeTrainer

            return build_megatron_trainer(plan, BridgeTrainer)
        return build_megatron_trainer(plan)
    return FSDPTrainer(plan.model_path, TrainerSettings.from_plan(plan))


def build_multi_lora_trainer(plan: Plan) -> MultiLoRATrainer:
    """This rank's trainer of a multi-LoRA plan: raw LoRA slots on Megatron's model (or Bridge's) for
    trainer=megatron, else peft's."""
    _compute_threads(plan)
    if plan.trainer.backend == "megatron":
        from miles_runner.trainer.megatron.multi_lora import build_megatron_multi_lora_trainer

        if plan.trainer.lora_mode == "bridge":  # Megatron-Bridge's model (Python 3.12), raw LoRA slots
            from miles_runner.trainer.megatron.bridge import BridgeMultiLoRATrainer

            return build_megatron_multi_lora_trainer(plan, BridgeMultiLoRATrainer)
        return build_megatron_multi_lora_trainer(plan)
    return PeftMultiLoRATrainer(plan.model_path, MultiLoRASettings.from_plan(plan))


def _compute_threads(plan: Plan) -> None:
    if plan.cluster.cpu_only:
        # One intra-op thread per rank, as the embedded engine has: each holds one CPU device, the matrices are tiny,
        # and a second OpenMP thread would wait at every op's barrier for a core that the engine or another rank is
        # using (bench/single_turn_step.py times the train step both ways).
        torch.set_num_threads(1)


class Follower(Protocol):
    """A follower rank's process, here (procs.ManagedProcess) or on another node (the node agent's handle)."""

    name: str
    log_path: Path

    @property
    def alive(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...

    def stop(self) -> Any: ...


class RemoteRanks(Protocol):
    """Starts the follower ranks placed on nodes other than the driver's (the Ray executor's node agents)."""

    master_address: str  # node 0's own address, where rank 0 listens

    def start_rank(self, name: str, node: int, launch: Launch) -> Follower: ...


def make_trainer(plan: Plan, run_dir: Path, remote: RemoteRanks | None = None) -> RankedTrainer:
    """The driver's trainer of a one-adapter plan: rank 0 of `world_size` ranks (followers started where the plan
    places them), or alone for one rank. `remote` starts the ranks on other nodes (a multi-node plan). Call
    `close()` when done."""
    return RankedTrainer(*_start_ranks(plan, Path(run_dir), remote, build_trainer))


def make_multi_lora_trainer(plan: Plan, run_dir: Path, remote: RemoteRanks | None = None) -> RankedMultiLoRATrainer:
    """The driver's trainer of a multi-LoRA plan, as `make_trainer`."""
    return RankedMultiLoRATrainer(*_start_ranks(plan, Path(run_dir), remote, build_multi_lora_trainer))


def _start_ranks(
    plan: Plan, run_dir: Path, remote: RemoteRanks | None, build: Callable[[Plan], T]
) -> tuple[T, list[Follower], Any]:
    """Rank 0's trainer, the followers that replay its calls and the group the calls travel on (none of either
    for one rank). The followers build their trainers as rank 0 builds its own: the constructors hold
    collectives."""
    if plan.trainer.parallel.world_size <= 1:
        return build(plan), [], None
    master = remote.master_address if remote else LOOPBACK
    port, followers = free_port(master), []
    try:
        for rank in range(1, plan.trainer.parallel.world_size):
            followers.append(start_follower(plan, run_dir, rank, master, port, remote))
        commands = join_group(plan, 0, master, port)
        return build(plan), followers, commands
    except BaseException:
        for follower in followers:
            follower.stop()
        raise


def join_group(plan: Plan, rank: int, master_address: str, master_port: int) -> Any:
    """Join the trainer's default process group at rank 0's address; returns the group commands travel on
    (gloo)."""
    backend = "gloo" if plan.cluster.cpu_only else "nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_address}:{master_port}",
        rank=rank,
        world_size=plan.trainer.parallel.world_size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    return dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")


def _receive(commands: Any) -> tuple[str, tuple, dict]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=commands)
    return box[0]


class _Ranks(Generic[T]):
    """Rank 0's trainer (`_local`) and the followers that replay its calls (none: it is just the trainer)."""

    def __init__(self, local: T, followers: list[Follower], commands: Any) -> None:
        self._local, self._followers, self._commands = local, followers, commands
        # One replayed call at a time, and none while close() sends the exit: on CPU the commands share the gloo
        # group the trainer's collectives use, and two threads' operations on it interleave differently on each rank.
        self._calling = threading.Lock()

    def _replay(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Rank 0's trainer's method `name`, after sending the call to every follower."""
        with self._calling:
            if self._followers:
                self._check_followers()
                dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self._commands)
            return getattr(self._local, name)(*args, **kwargs)

    def _check_followers(self) -> None:
        dead = [f"{f.name} (exit code {f.returncode}; {f.log_path})" for f in self._followers if not f.alive]
        if dead:
            raise RuntimeError(f"trainer ranks exited: {', '.join(dead)}")

    def close(self, timeout_s: float = 30.0) -> None:
        """Tell the followers to leave, wait for them, and leave the group (idempotent).

        A replayed call still running in another thread (the train step of a loop that Ctrl-C cancelled goes on in
        its worker thread) ends first, for up to `timeout_s`: an exit sent amid its collectives would leave rank 0's
        broadcast and a follower's all-reduce waiting on each other until the group's timeout (TIMEOUT_S). A call
        that outlasts `timeout_s` is cut off instead: the followers are stopped, which ends its collectives with an
        error.
        """
        if not self._followers:
            return
        idle = self._calling.acquire(timeout=timeout_s)
        try:
            if idle and all(f.alive for f in self._followers):
                dist.broadcast_object_list([(EXIT, (), {})], src=0, group=self._commands)
            deadline = time.monotonic() + timeout_s
            while any(f.alive for f in self._followers) and time.monotonic() < deadline:
                time.sleep(0.05)
            for follower in self._followers:
                follower.stop()
            self._followers = []
            if idle:  # (a call still in the group's collectives would be destroyed under it)
                dist.destroy_process_group()
        finally:
            if idle:
                self._calling.release()


class RankedTrainer(_Ranks[Trainer]):
    """Rank 0's `Trainer` of every rank."""

    def train(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        return self._replay("train", samples)

    def compute_log_probs(self, samples: Sequence[TrainingSample], *, adapter: bool = True) -> list[list[float]]:
        return self._replay("compute_log_probs", samples, adapter=adapter)

    def probe_log_probs(self, token_ids: Sequence[int]) -> list[float]:
        return self._replay("probe_log_probs", token_ids)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return self._replay("adapter_state")

    def adapter_views(self) -> dict[str, torch.Tensor] | None:
        return self._local.adapter_views()  # rank 0's own: views exist only where one rank holds the whole adapter

    def move_adapter(self, homes: dict[str, torch.Tensor]) -> None:
        self._local.move_adapter(homes)

    def adapter_config(self) -> dict[str, Any]:
        return self._replay("adapter_config")  # Bridge's reads the names its export gives: collective

    def save_adapter(self, out_dir: str | Path) -> Path:
        return self._replay("save_adapter", out_dir)

    def state_dict(self) -> dict[str, Any]:
        return self._replay("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._replay("load_state_dict", state)

    def offload_state(self) -> dict[str, Any]:
        return self._replay("offload_state")

    def onload_state(self) -> dict[str, Any]:
        return self._replay("onload_state")


class RankedMultiLoRATrainer(_Ranks[MultiLoRATrainer]):
    """Rank 0's `MultiLoRATrainer` of every rank."""

    def load_adapter(self, slot: int, adapter: AdapterSpec, state: dict[str, Any] | None = None) -> None:
        self._replay("load_adapter", slot, adapter, state)

    def clear_adapter(self, slot: int) -> None:
        self._replay("clear_adapter", slot)

    def train(self, samples: Sequence[TrainingSample], step_slots: Collection[int]) -> dict[int, dict[str, float]]:
        return self._replay("train", samples, step_slots)

    def probe_log_probs(self, token_ids: Sequence[int], slot: int) -> list[float]:
        return self._replay("probe_log_probs", token_ids, slot)

    def adapter_state(self, slot: int) -> dict[str, torch.Tensor]:
        return self._replay("adapter_state", slot)

    def adapter_config(self, slot: int) -> dict[str, Any]:
        return self._replay("adapter_config", slot)

    def adapter_step(self, slot: int) -> int:
        return self._local.adapter_step(slot)

    def state_dict(self, slot: int) -> dict[str, Any]:
        return self._replay("state_dict", slot)


def start_follower(
    plan: Plan, run_dir: Path, rank: int, master: str, port: int, remote: RemoteRanks | None
) -> Follower:
    """Start follower `rank` on the node its placement names: here on node 0, else by that node's agent."""
    node, device = plan.trainer.placements[rank]
    launch, name = trainer_rank_launch(str(Path(run_dir).resolve()), rank, device, master, port), f"trainer{rank}"
    if node == 0:
        return launch_process(name, launch, Path(run_dir) / "logs", startup_timeout_s=0).start()
    if remote is None:
        raise RuntimeError(
            f"trainer rank {rank} is placed on node {node}: only the Ray executor's node agents "
            "start ranks on other nodes"
        )
    return remote.start_rank(name, node, launch)


def follow(run_dir: Path, rank: int, master_address: str, master_port: int) -> None:
    """A follower rank: build the plan's trainer, then replay rank 0's calls until told to exit."""
    plan = read_plan(run_dir / "plan.yaml")
    commands = join_group(plan, rank, master_address, master_port)
    trainer: Trainer | MultiLoRATrainer = (
        build_multi_lora_trainer(plan) if plan.capabilities.multi_lora else build_trainer(plan)
    )
    freeze_startup_heap()
    while (command := _receive(commands))[0] != EXIT:
        name, args, kwargs = command
        try:
            getattr(trainer, name)(*args, **kwargs)
        except Exception:  # rank 0 raised the same (same arguments): its caller decides what happens next
            log.exception("rank %d: %s failed", rank, name)
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_runner.trainer.ranks", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master-address", default=LOOPBACK, help="rank 0's node address")
    parser.add_argument("--master-port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    follow(args.run_dir, args.rank, args.master_address, args.master_port)


if __name__ == "__main__":
    main()
