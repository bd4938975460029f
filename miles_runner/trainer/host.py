"""A trainer in an interpreter of its own (`trainer.python`): the driver's `Trainer` (or `MultiLoRATrainer`, for a
multi-LoRA plan) is a proxy of a host process.

Megatron-Bridge 0.6.2 needs Python 3.12 and a torch build of its own, while the rest of the runner (Ray, the
router, the session server, the CPU torch) runs in the project's environment; on a GPU cluster the two are one
environment, on a laptop or CI box they are two. With `trainer.python` set, the plan's trainer line
(plan.trainer.host) starts `<that python> -m miles_runner.trainer.host RUN_DIR --connect SOCKET`: it builds rank 0
of the plan's trainer (which starts the other ranks with its own interpreter, trainer/ranks.py) and answers the
driver's calls one at a time, as miles' driver calls its Ray train actors.

    driver                                       trainer host (trainer.python)
    HostedTrainer.train(samples)  ---frame--->   trainer.train(samples) -> metrics
                                  <--frame---    (OK, metrics) or (FAILED, "Type: message", traceback)

The socket is a Unix socket in a folder only the driver's user may enter (it listens, the host connects). A
failed call is raised in the driver with the host's traceback; a host that dies is named with its log, as any
component of the run; a driver that dies takes the host with it (PR_SET_PDEATHSIG, procs/process.py) and an
end of file on the socket ends the host too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import shutil
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Collection, Sequence
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

import torch

from miles_runner.core.adapters import AdapterSpec
from miles_runner.core.errors import ComponentFailure
from miles_runner.plan.model import Plan
from miles_runner.plan.record import read_plan
from miles_runner.plan.render import TRAINER_SOCKET
from miles_runner.procs.launch import launch_process
from miles_runner.procs.process import ManagedProcess
from miles_runner.trainer.host_wire import CLOSE, FAILED, OK, receive, send
from miles_runner.trainer.logprobs import TrainingSample
from miles_runner.trainer.ranks import (
    RankedMultiLoRATrainer,
    RankedTrainer,
    RemoteRanks,
    make_multi_lora_trainer,
    make_trainer,
)

log = logging.getLogger(__name__)

READY = "ready"
BUILD_TIMEOUT_S = 900.0  # a cold Megatron-Bridge import and model build; the host's death ends the wait sooner
# The trainer methods a driver may call (the `Trainer` Protocol, less the in-memory adapter views).
CALLS = frozenset(
    {
        "train",
        "compute_log_probs",
        "probe_log_probs",
        "adapter_state",
        "adapter_config",
        "save_adapter",
        "state_dict",
        "load_state_dict",
        "offload_state",
        "onload_state",
    }
)
# A multi-LoRA plan's: the `MultiLoRATrainer` Protocol.
MULTI_LORA_CALLS = frozenset(
    {
        "load_adapter",
        "clear_adapter",
        "train",
        "probe_log_probs",
        "adapter_state",
        "adapter_config",
        "adapter_step",
        "state_dict",
    }
)


class TrainerHostError(RuntimeError):
    """A call the trainer host ran raised: the host's exception and traceback."""


class _Host:
    """The driver's end of a trainer host: starts it, and sends it one call at a time."""

    def __init__(self, plan: Plan, run_dir: Path) -> None:
        assert plan.trainer.host is not None
        self._lock = threading.Lock()
        self._folder = Path(tempfile.mkdtemp(prefix="miles-trainer-"))  # mode 0700: only this user connects
        path = self._folder / "host.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(1)
        launch = plan.trainer.host
        argv = [str(path) if arg == TRAINER_SOCKET else arg for arg in launch.argv]
        self._process: ManagedProcess = launch_process(
            "trainer", dataclasses.replace(launch, argv=argv), Path(run_dir) / "logs", startup_timeout_s=0, cwd=run_dir
        ).start()
        try:
            self._connection = self._accept(listener)
            self._answer(READY, BUILD_TIMEOUT_S)
        except BaseException:
            self._process.stop()
            shutil.rmtree(self._folder, ignore_errors=True)
            raise
        finally:
            listener.close()

    def _accept(self, listener: socket.socket) -> Connection:
        listener.settimeout(0.2)
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while True:
            try:
                connected, _ = listener.accept()
                connected.setblocking(True)
                return Connection(connected.detach())
            except TimeoutError:
                self._check_alive("while it started")
                if time.monotonic() > deadline:
                    raise self._process.start_failed("did not connect") from None

    def _check_alive(self, when: str) -> None:
        if not self._process.alive:
            raise ComponentFailure(
                "trainer",
                f"exited with code {self._process.returncode} {when}",
                log_path=str(self._process.log_path),
                log_tail=self._process.log_tail(),
            )

    def _answer(self, expected: str | None, timeout_s: float | None = None) -> Any:
        """The host's answer to the last frame sent: waits while the host lives (a train step has no bound)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._connection.poll(0.5):
            self._check_alive("during a call")
            if deadline is not None and time.monotonic() > deadline:
                raise self._process.start_failed("did not finish building the trainer")
        status, *rest = receive(self._connection)
        if status == FAILED:
            message, remote_traceback = rest
            raise TrainerHostError(f"{message}\n(trainer host traceback)\n{remote_traceback}")
        if expected is not None and status != expected:
            raise TrainerHostError(f"trainer host answered {status!r}, not {expected!r}")
        return rest[0] if rest else None

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._check_alive("before a call")
            try:
                send(self._connection, (name, args, kwargs))
                return self._answer(OK)
            except (EOFError, OSError):  # the socket closed under the call: the host died
                deadline = time.monotonic() + 5.0
                while self._process.alive and time.monotonic() < deadline:  # for its exit code
                    time.sleep(0.05)
                self._check_alive("during a call")
                raise

    def close(self, timeout_s: float = 30.0) -> None:
        """Tell the host to close its trainer (its ranks leave) and wait for it to exit (idempotent)."""
        if self._folder is None:
            return
        if self._lock.acquire(timeout=timeout_s):  # not amid a call another thread still waits on
            try:
                with contextlib.suppress(OSError):
                    send(self._connection, (CLOSE, (), {}))
            finally:
                self._lock.release()
        deadline = time.monotonic() + timeout_s
        while self._process.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        self._process.stop()
        self._connection.close()
        shutil.rmtree(self._folder, ignore_errors=True)
        self._folder = None  # type: ignore[assignment]


class HostedTrainer(_Host):
    """The driver's `Trainer` of a plan whose trainer runs in `trainer.python`: every call goes to the host."""

    def train(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        return self._call("train", samples)

    def compute_log_probs(self, samples: Sequence[TrainingSample], *, adapter: bool = True) -> list[list[float]]:
        return self._call("compute_log_probs", samples, adapter=adapter)

    def probe_log_probs(self, token_ids: Sequence[int]) -> list[float]:
        return self._call("probe_log_probs", list(token_ids))

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return self._call("adapter_state")

    def adapter_views(self) -> dict[str, torch.Tensor] | None:
        return None  # the tensors live in another process: every export is a copy

    def move_adapter(self, homes: dict[str, torch.Tensor]) -> None:
        raise RuntimeError("a hosted trainer's adapter lives in its own process; it has no views to move")

    def adapter_config(self) -> dict[str, Any]:
        return self._call("adapter_config")

    def save_adapter(self, out_dir: str | Path) -> Path:
        return Path(self._call("save_adapter", str(Path(out_dir).resolve())))

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def offload_state(self) -> dict[str, Any]:
        return self._call("offload_state")

    def onload_state(self) -> dict[str, Any]:
        return self._call("onload_state")


class HostedMultiLoRATrainer(_Host):
    """The driver's `MultiLoRATrainer` of a multi-LoRA plan whose trainer runs in `trainer.python`."""

    def load_adapter(self, slot: int, adapter: AdapterSpec, state: dict[str, Any] | None = None) -> None:
        self._call("load_adapter", slot, adapter, state)

    def clear_adapter(self, slot: int) -> None:
        self._call("clear_adapter", slot)

    def train(self, samples: Sequence[TrainingSample], step_slots: Collection[int]) -> dict[int, dict[str, float]]:
        return self._call("train", samples, list(step_slots))

    def probe_log_probs(self, token_ids: Sequence[int], slot: int) -> list[float]:
        return self._call("probe_log_probs", list(token_ids), slot)

    def adapter_state(self, slot: int) -> dict[str, torch.Tensor]:
        return self._call("adapter_state", slot)

    def adapter_config(self, slot: int) -> dict[str, Any]:
        return self._call("adapter_config", slot)

    def adapter_step(self, slot: int) -> int:
        return self._call("adapter_step", slot)

    def state_dict(self, slot: int) -> dict[str, Any]:
        return self._call("state_dict", slot)


DriverTrainer = RankedTrainer | HostedTrainer
DriverMultiLoRATrainer = RankedMultiLoRATrainer | HostedMultiLoRATrainer


def open_trainer(plan: Plan, run_dir: Path, remote: RemoteRanks | None = None) -> DriverTrainer:
    """The driver's trainer of a one-adapter plan: a host process where the plan names one, else rank 0 here.
    `remote` starts ranks on other nodes; a hosted trainer has none (hosted-trainer-multi-node-not-built)."""
    if plan.trainer.host is None:
        return make_trainer(plan, run_dir, remote)
    return HostedTrainer(plan, run_dir)


def open_multi_lora_trainer(plan: Plan, run_dir: Path, remote: RemoteRanks | None = None) -> DriverMultiLoRATrainer:
    """The driver's trainer of a multi-LoRA plan, as `open_trainer`."""
    if plan.trainer.host is None:
        return make_multi_lora_trainer(plan, run_dir, remote)
    return HostedMultiLoRATrainer(plan, run_dir)


def serve(run_dir: Path, socket_path: str) -> None:
    """The host: build rank 0 of the plan's trainer, then answer the driver's calls until it closes or goes."""
    connection = Client(socket_path, family="AF_UNIX")
    run_dir = run_dir.resolve()  # the ranks' logs and plan, wherever they are started from
    try:
        plan = read_plan(run_dir / "plan.yaml")
        multi = plan.capabilities.multi_lora
        trainer = make_multi_lora_trainer(plan, run_dir) if multi else make_trainer(plan, run_dir)
        calls = MULTI_LORA_CALLS if multi else CALLS
    except Exception as error:
        send(connection, (FAILED, f"building the trainer: {type(error).__name__}: {error}", traceback.format_exc()))
        raise
    send(connection, (READY,))
    try:
        while True:
            try:
                name, args, kwargs = receive(connection)
            except EOFError:  # the driver went
                return
            if name == CLOSE:
                return
            send(connection, _run(trainer, calls, name, args, kwargs))
    finally:
        trainer.close()


def _run(
    trainer: RankedTrainer | RankedMultiLoRATrainer, calls: frozenset[str], name: str, args: tuple, kwargs: dict
) -> tuple:
    if name not in calls:
        return FAILED, f"ValueError: {name!r} is not a trainer call", ""
    try:
        return OK, getattr(trainer, name)(*args, **kwargs)
    except Exception as error:
        log.exception("%s failed", name)
        return FAILED, f"{type(error).__name__}: {error}", traceback.format_exc()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_runner.trainer.host", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--connect", required=True, help="the driver's Unix socket")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    serve(args.run_dir, args.connect)


if __name__ == "__main__":
    main()
