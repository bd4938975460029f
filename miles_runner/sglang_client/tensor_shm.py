"""Tensors handed to an embedded engine on the same host through shared memory: the CPU analogue of SGLang's
CUDA IPC handles.

On GPUs, SGLang's tensor routes receive MultiprocessingSerializer bytes, a pickle of CUDA IPC handles: the tensors
never travel in the request, only handles the engine maps (same node), and the engine copies from the trainer's
own memory. Here the tensors are a safetensors file in a segment of /dev/shm that the trainer owns: the memory its
adapter parameters live in (SharedTensors), or a segment it rewrites for each push with tensors that are copies
(TensorSegment); each entry of `serialized_named_tensors` is a handle naming that segment. The engine opens it
(a name of this module's pattern, directly in /dev/shm, a regular file of its own user, not a link), copies the
tensors into memory of its own (SegmentReader: the adapter's load copies from views of the mapped segment;
read_segment: one buffer read from the file) and answers; the trainer changes the segment only after that answer
(its next optimizer step, or the next request's rewrite), so nothing the engine keeps may point into it. The engine
parses the safetensors header itself, since safetensors' own loaders return views of a map of the file. Engines on
other hosts get the tensors inline (tensor_wire.py).

Handle entry: base64 of b"miles-shm:" + the segment's name. A safetensors blob starts with its header's length as 8
little-endian bytes; b"miles-sh" read so is about 7.6e18, which no blob has, so the two kinds never meet.

Speed (bench/adapter_sync_bandwidth.py): the engine keeps the segment mapped and its header parsed (SegmentReader),
so a sync costs one copy of the bytes, the engine's, out of the trainer's parameters into the adapter's weights
(two for copies: into the rewritten segment first), and no base64 or JSON of them, which are most of an inline
load's cost. The bench reports both paths, and each against a plain copy of the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import secrets
import stat
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
HANDLE_PREFIX = b"miles-shm:"
SEGMENT_NAME = re.compile(r"miles-tensors-(\d+)-[0-9a-f]{16}")
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
LOOPBACK_HOSTS = {"localhost", "::1"}


def shared_memory_available() -> bool:
    """Whether this host has the POSIX shared-memory folder the segments live in (Linux)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK | os.X_OK)


def on_this_host(base_url: str) -> bool:
    """Whether an engine at `base_url` runs on this host (a loopback address): only it can open our segments."""
    host = urlsplit(base_url).hostname or ""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def is_handle(blob: bytes) -> bool:
    return blob.startswith(HANDLE_PREFIX)


class TensorSegment:
    """A /dev/shm segment this process owns, rewritten in place by each `write` (resized when the bytes change);
    removed by `close`, when the object is collected, or at exit. One writer at a time: a write must wait until
    every engine has answered the request that carried the previous handle."""

    def __init__(self) -> None:
        _remove_orphans()
        self.name = f"miles-tensors-{os.getpid()}-{secrets.token_hex(8)}"
        self.path = SHM_DIR / self.name
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None  # a uint8 view of the map, what the tensors are copied into
        self._finalizer = weakref.finalize(self, _remove, self.path, self._fd)

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
        """Write the tensors as one safetensors file; returns the handle (the entry's bytes, before base64)."""
        tensors = [(name, _plain(tensor)) for name, tensor in named_tensors]
        header, data_bytes = _header(tensors)
        prefix = len(header).to_bytes(8, "little") + header
        target = self._reserve(len(prefix) + data_bytes)
        target[: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
        offset = len(prefix)
        for _, tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            target[offset : offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
            offset += size
        return HANDLE_PREFIX + self.name.encode("ascii")

    def close(self, *, unmap: bool = True) -> None:
        """Remove the segment. `unmap=False` where tensors still use the map: it goes when the last of them does
        (each holds the map object; closing it under them would leave them pointing at unmapped memory)."""
        if unmap:
            self._unmap()
        else:
            self._map, self._bytes = None, None
        self._finalizer()

    def views(self) -> dict[str, torch.Tensor]:
        """Writable views of the tensors the last `write` put here (the map, not copies)."""
        if self._bytes is None:
            raise ValueError(f"tensor segment {self.name} holds nothing yet")
        return _tensors_of(self._bytes)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory lies in the map."""
        if self._bytes is None:
            return False
        start = self._bytes.data_ptr()
        return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= start + self._bytes.numel()

    def _reserve(self, size: int) -> torch.Tensor:
        """The map, at exactly `size` bytes (safetensors wants the file to end where its data ends)."""
        if self._map is None or len(self._map) != size:
            self._unmap()
            os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        assert self._bytes is not None
        return self._bytes

    def _unmap(self) -> None:
        self._bytes = None  # the view exports the map's buffer, which must be released before the map closes
        if self._map is not None:
            self._map.close()
            self._map = None


class SharedTensors:
    """Tensors whose memory is a segment of /dev/shm, laid out as a safetensors file: a trainer's adapter parameters
    move here, and an engine on this host loads them straight from it, one copy into its own weights, as SGLang's
    engines read a GPU trainer's tensors through CUDA IPC handles (no copy into a hand-off buffer first).

    The segment is written once, when the tensors move in; from then on their owner changes them in place (an
    optimizer step), which it must not do while an engine reads them: a push returns once every engine has loaded.
    `close` removes the segment; its memory stays mapped until the last tensor using it is gone."""

    def __init__(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        self._segment, self._closed = TensorSegment(), False
        self.handle = self._segment.write(named_tensors.items())
        self.tensors = self._segment.views()
        if not all(self._segment.holds(view) for view in self.tensors.values()):
            self.close()  # a dtype mix left a tensor unaligned: its view had to be a copy of its own
            raise ValueError("these tensors cannot all be laid out in shared memory in place; send them as copies")

    def handle_for(self, named_tensors: Mapping[str, torch.Tensor]) -> bytes | None:
        """The segment's handle when `named_tensors` are exactly these tensors (the same memory, shapes and dtypes),
        else None: then they need a copy of their own."""
        if self._closed or named_tensors.keys() != self.tensors.keys():
            return None
        same = all(_layout(tensor) == _layout(self.tensors[name]) for name, tensor in named_tensors.items())
        return self.handle if same else None

    def close(self) -> None:
        self._closed = True
        self._segment.close(unmap=False)


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device


def read_segment(name: str) -> dict[str, torch.Tensor]:
    """The tensors of the segment a handle names, read into one buffer of this process (nothing stays mapped);
    ValueError when the name is not a segment's, or the segment is missing, not this user's regular file, or not a
    well-formed safetensors file."""
    fd, status = _open_segment(name)
    try:
        data = np.empty(status.st_size, dtype=np.uint8)
        _read_into(fd, data)
    finally:
        os.close(fd)
    return _checked_tensors(name, torch.from_numpy(data))


class SegmentReader:
    """An engine's reader of the segments handles name, which keeps the last one mapped: the trainer rewrites the
    same segment for every push (or its parameters live in one), so its pages are mapped once and each read is one
    copy from warm memory; the views of an unchanged header are kept too (parsing it was a tenth of a small
    adapter's load). The views `borrow` yields are valid only inside its block (the next push rewrites them, and a
    remap unmaps them): copy what you keep."""

    def __init__(self) -> None:
        self._key: tuple[int, int, int] | None = None  # (device, inode, size) of the mapped file
        self._map: mmap.mmap | None = None
        self._parsed: tuple[bytes, dict[str, torch.Tensor]] | None = None  # (header, its views of the map)

    @contextlib.contextmanager
    def borrow(self, name: str) -> Iterator[dict[str, torch.Tensor]]:
        fd, status = _open_segment(name)
        try:
            key = (status.st_dev, status.st_ino, status.st_size)
            if key != self._key:
                self.close()
                self._map = mmap.mmap(fd, status.st_size, prot=mmap.PROT_READ) if status.st_size else None
                self._key = key
        finally:
            os.close(fd)
        if self._map is None:
            raise ValueError(f"tensor segment {name} is not a well-formed safetensors file: it is empty")
        yield dict(self._views(name, self._map))

    def _views(self, name: str, mapped: mmap.mmap) -> dict[str, torch.Tensor]:
        """The tensors of the mapped segment: the kept views when its header has not changed since they were made
        (the same map, names, shapes and offsets), else parsed anew."""
        header = mapped[: 8 + int.from_bytes(mapped[:8], "little")]  # a length past the end: all there is
        if self._parsed is not None and self._parsed[0] == header:
            return self._parsed[1]
        with warnings.catch_warnings():  # a read-only map: the views are only ever read
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(mapped, dtype=torch.uint8)
        tensors = _checked_tensors(name, data)
        start, end = data.data_ptr(), data.data_ptr() + len(data)
        # An unaligned tensor's "view" is a copy of this read (_tensors_of): such a parse is not kept.
        in_map = all(t.numel() == 0 or start <= t.data_ptr() < end for t in tensors.values())
        self._parsed = (header, tensors) if in_map else None
        return tensors

    def close(self) -> None:
        """Unmap (on a remap, and at shutdown): views of the map must not be used after (they hold no export of
        it, so the map closes under them)."""
        mapped, self._map, self._key, self._parsed = self._map, None, None, None
        if mapped is not None:
            with contextlib.suppress(BufferError):
                mapped.close()


def _open_segment(name: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the segment `name` and its status, once it is known to be this user's regular
    file directly in SHM_DIR (a link is not followed)."""
    if not SEGMENT_NAME.fullmatch(name):
        raise ValueError(f"not a tensor segment name: {name[:80]!r}")
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(
            f"tensor segment {name} cannot be opened here ({exc.strerror}): is the engine on the trainer's host, "
            "sharing its /dev/shm?"
        ) from exc
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid():
        os.close(fd)
        raise ValueError(f"tensor segment {name} is not a regular file of this user")
    return fd, status


def _checked_tensors(name: str, data: torch.Tensor) -> dict[str, torch.Tensor]:
    try:
        return _tensors_of(data)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise ValueError(f"tensor segment {name} is not a well-formed safetensors file: {exc}") from exc


def _read_into(fd: int, data: np.ndarray) -> None:
    view, done = data.data, 0
    while done < len(view):
        count = os.readv(fd, [view[done:]])
        if count == 0:
            raise ValueError("tensor segment ended early: it shrank while being read")
        done += count


def _tensors_of(data: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of the tensors a safetensors file holds, over `data` (the whole file), each checked to lie in it."""
    header_size = int.from_bytes(data[:8].numpy().tobytes(), "little")
    start = 8 + header_size
    if len(data) < 8 or start > len(data):
        raise ValueError("the header runs past the end of the file")
    header = json.loads(data[8:start].numpy().tobytes())
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, (first, last) = DTYPES_BY_NAME[entry["dtype"]], entry["shape"], entry["data_offsets"]
        size = math.prod(shape) * dtype.itemsize
        if not (first >= 0 and last == first + size and start + last <= len(data)):
            raise ValueError(f"tensor {key!r}: data offsets {[first, last]} do not fit its shape {shape} or the file")
        chunk = data[start + first : start + last]
        aligned = (start + first) % dtype.itemsize == 0  # a view needs its element size's alignment
        tensors[key] = (chunk if aligned else chunk.clone()).view(dtype).view(shape)
    return tensors


def handle_segment_name(blob: bytes) -> str:
    return blob[len(HANDLE_PREFIX) :].decode("ascii", errors="replace")


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype not in SAFETENSORS_DTYPES:
        raise TypeError(f"dtype {tensor.dtype} has no safetensors name here; send these tensors inline")
    return tensor


def _header(tensors: list[tuple[str, torch.Tensor]]) -> tuple[bytes, int]:
    """The safetensors header (JSON, padded with spaces to 8 bytes as safetensors writes it) and the data's size."""
    entries: dict[str, dict] = {}
    offset = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8), offset


def _remove(path: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _remove_orphans() -> None:
    """Remove the segments of this user's processes that are gone (killed before they could remove their own)."""
    for path in SHM_DIR.glob("miles-tensors-*"):
        match = SEGMENT_NAME.fullmatch(path.name)
        if match and _owned_by_me(path) and not _alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _owned_by_me(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return path.lstat().st_uid == os.getuid()
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
