"""Training offload (topology.offload_train): the trainer's state leaves its device while the engines generate, and
comes back for the next train (docs/system.md §7: train -> save -> offload the trainer -> onload the engines).

What moves, as miles moves it for a LoRA actor (torch_memory_saver regions in miles' megatron actor): the frozen base
weights, the gradients and the optimizer state. The adapter's own parameters stay where they are (miles allocates
them outside the paused region: a colocated push reads them while the trainer is offloaded), so the tensors an
engine was handed (trainer/policy_trainer.py adapter_views) stay valid.

Targets (trainer.offload_target):
- `cpu`: each tensor is moved to host memory and back to its device. On a CPU host that moves nothing (the plan's
  summary says so); the tensors stay as they are.
- `disk`: the tensors are written to chunk files of at most `chunk_mb` in a scratch folder (miles' default:
  `$SCRATCH/miles_train_offload_<uid>`, one subfolder per rank) and their storage is freed, then read back and the
  files removed. On a CPU host this is what really frees memory.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from miles_runner.core.host_memory import return_freed_pages
from miles_runner.plan.model import Plan

CPU = torch.device("cpu")
PIECE, LAST_PIECE = "#", "$"  # chunk entries are `<tensor key>#<i>`, the tensor's last piece ending in `$`


@dataclass(frozen=True)
class OffloadSettings:
    target: str  # cpu | disk
    disk_dir: str = ""  # "": $SCRATCH (else the system's temporary folder)/miles_train_offload_<uid>
    chunk_mb: float = 64

    def folder(self, rank: int) -> Path:
        root = Path(self.disk_dir) if self.disk_dir else default_disk_dir()
        return root / f"rank{rank}"


def offload_settings(plan: Plan) -> OffloadSettings | None:
    """The plan's training offload, or None where the trainer stays resident."""
    t = plan.trainer
    return OffloadSettings(t.offload_target, t.offload_disk_dir, t.offload_disk_chunk_mb) if t.offload_train else None


def default_disk_dir() -> Path:
    return Path(os.environ.get("SCRATCH") or tempfile.gettempdir()) / f"miles_train_offload_{os.getuid()}"


@dataclass(frozen=True)
class OffloadReport:
    moved_bytes: int  # what left (or came back to) the trainer's memory
    seconds: float
    chunks: int = 0  # disk target: the files written (or read back)


class TrainStateOffload:
    """Moves a trainer's frozen weights, gradients and optimizer state out (`offload`) and back (`onload`)."""

    def __init__(self, settings: OffloadSettings, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int):
        self.settings, self.model, self.optimizer, self.rank = settings, model, optimizer, rank
        self.offloaded = False
        self._devices: dict[str, torch.device] = {}  # where each tensor lives while resident (cpu target)
        self._layouts: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}  # disk target: to rebuild them
        self._chunks: list[Path] = []  # disk target: the files holding the offloaded tensors
        self._cleanup_registered = False

    def offload(self) -> OffloadReport:
        if self.offloaded:
            return OffloadReport(0, 0.0)
        started = time.perf_counter()
        tensors = dict(self._state())
        moved = self._to_disk(tensors) if self.settings.target == "disk" else self._to_host(tensors)
        self.offloaded = True
        if moved:  # a full collection costs a noticeable fraction of a second: only when there is memory to return
            return_freed_pages()
        if torch.cuda.is_available():  # the caching allocator keeps freed blocks: hand them to the engines
            torch.cuda.empty_cache()
        return OffloadReport(moved, time.perf_counter() - started, len(self._chunks))

    def onload(self) -> OffloadReport:
        if not self.offloaded:
            return OffloadReport(0, 0.0)
        started, chunks = time.perf_counter(), len(self._chunks)
        moved = self._from_disk() if self.settings.target == "disk" else self._from_host()
        self.offloaded = False
        return OffloadReport(moved, time.perf_counter() - started, chunks)

    # ---- what moves ----

    def _state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor that moves, by a name that finds it again: frozen parameters, gradients, optimizer state."""
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                yield f"param/{name}", param.data
            elif param.grad is not None:
                yield f"grad/{name}", param.grad
        index = {id(p): name for name, p in self.model.named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:  # a scalar step counter stays
                    yield f"optim/{index[id(param)]}/{key}", value

    def _put(self, key: str, tensor: torch.Tensor | None) -> None:
        """Give the tensor named `key` its storage: `tensor`, or (None) none while it is on disk: an empty tensor
        of its dtype, or no gradient."""
        kind, _, rest = key.partition("/")
        params = dict(self.model.named_parameters())
        if kind == "grad":
            params[rest].grad = tensor
            return
        if kind == "param":
            param = params[rest]
            param.data = tensor if tensor is not None else torch.empty(0, dtype=param.dtype, device=param.device)
            return
        name, _, state_key = rest.rpartition("/")
        state = self.optimizer.state[params[name]]
        old = state[state_key]
        state[state_key] = tensor if tensor is not None else torch.empty(0, dtype=old.dtype, device=old.device)

    # ---- cpu target ----

    def _to_host(self, tensors: dict[str, torch.Tensor]) -> int:
        self._devices = {key: t.device for key, t in tensors.items()}
        moved = 0
        for key, tensor in tensors.items():
            if tensor.device != CPU:
                self._put(key, tensor.to(CPU, non_blocking=False))
                moved += tensor.nbytes
        return moved

    def _from_host(self) -> int:
        moved = 0
        for key, tensor in dict(self._state()).items():
            device = self._devices.get(key, CPU)
            if device != CPU:
                self._put(key, tensor.to(device))
                moved += tensor.nbytes
        return moved

    # ---- disk target ----

    def _to_disk(self, tensors: dict[str, torch.Tensor]) -> int:
        """Write the tensors as pieces of at most chunk_mb, packed into chunk files of at most chunk_mb, freeing each
        tensor once its last piece is written (the peak stays one chunk above the state)."""
        from safetensors.torch import save_file

        folder = self.settings.folder(self.rank)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        if not self._cleanup_registered:  # a run that ends while offloaded leaves no chunks behind
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            self._cleanup_registered = True
        self._layouts = {key: (t.shape, t.dtype, t.device) for key, t in tensors.items()}
        limit, moved = int(self.settings.chunk_mb * 2**20), 0
        for index, chunk in enumerate(_chunks(_pieces(tensors, limit), limit)):
            path = folder / f"chunk{index:05d}.safetensors"
            save_file({name: piece.detach().cpu().contiguous() for name, piece in chunk.items()}, path)
            self._chunks.append(path)
            for name, piece in chunk.items():
                moved += piece.nbytes
                if name.endswith(LAST_PIECE):  # the tensor's last piece: all of it is on disk
                    self._put(name.split(PIECE)[0], None)
        return moved

    def _from_disk(self) -> int:
        from safetensors.torch import load_file

        moved, filled = 0, {key: 0 for key in self._layouts}
        buffers = {key: torch.empty(shape.numel(), dtype=dtype) for key, (shape, dtype, _) in self._layouts.items()}
        for path in self._chunks:
            for name, piece in load_file(path).items():
                key = name.split(PIECE)[0]
                buffers[key][filled[key] : filled[key] + piece.numel()] = piece
                filled[key] += piece.numel()
                moved += piece.nbytes
            path.unlink()
        for key, (shape, _, device) in self._layouts.items():
            self._put(key, buffers[key].view(shape).to(device))
        self._chunks = []
        shutil.rmtree(self.settings.folder(self.rank), ignore_errors=True)
        return moved


def _pieces(tensors: dict[str, torch.Tensor], limit: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor as flat pieces of at most `limit` bytes, named `key#i`; the last one `key#i$`."""
    for key, tensor in tensors.items():
        flat = tensor.detach().reshape(-1)
        step = max(1, limit // max(1, tensor.element_size()))
        starts = range(0, max(1, flat.numel()), step)
        for i, start in enumerate(starts):
            yield f"{key}{PIECE}{i}{LAST_PIECE if i == len(starts) - 1 else ''}", flat[start : start + step]


def _chunks(pieces: Iterator[tuple[str, torch.Tensor]], limit: int) -> Iterator[dict[str, torch.Tensor]]:
    """The pieces in groups of at most `limit` bytes."""
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for key, tensor in pieces:
        if chunk and size + tensor.nbytes > limit:
            yield chunk
            chunk, size = {}, 0
        chunk[key], size = tensor, size + tensor.nbytes
    if chunk:
        yield chunk
