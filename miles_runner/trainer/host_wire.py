"""The calls between the driver and a trainer host (trainer/host.py): one pickled message per frame, tensors as
safetensors bytes.

The two ends may run different torch builds (the driver's Python 3.11 CPU torch, Megatron-Bridge's Python 3.12
one), and torch's own tensor pickles name storage internals that change between releases; safetensors is a
format both read. Everything else a trainer call carries is plain data or the runner's own dataclasses
(`TrainingSample`), which both ends import from the same source tree.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.connection import Connection
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

_TENSOR_KEY = "t"


def _rebuild_tensor(blob: bytes) -> torch.Tensor:
    return load_tensors(blob)[_TENSOR_KEY]


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            # contiguous copies of CPU data: a view keeps only what it shows, and safetensors stores no strides
            return _rebuild_tensor, (save_tensors({_TENSOR_KEY: obj.detach().cpu().contiguous()}),)
        return NotImplemented


def encode(message: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def decode(frame: bytes) -> Any:
    # Frames come only from the run's own processes, over a socket in a folder only this user may enter.
    return pickle.loads(frame)


def send(connection: Connection, message: Any) -> None:
    connection.send_bytes(encode(message))


def receive(connection: Connection) -> Any:
    return decode(connection.recv_bytes())


# A call: (method, args, kwargs). Its answer: (OK, result) or (FAILED, "ExceptionType: message", traceback text).
OK, FAILED = "ok", "failed"
CLOSE = "close"
