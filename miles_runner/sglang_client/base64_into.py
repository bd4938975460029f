"""Base64 decoded straight into a caller's buffer, at SIMD speed.

pybase64 returns a new bytes object per call, so a decoder that must place its output somewhere (the R3 merge:
each turn's routing patch into its rows of one tensor) pays a second pass over the bytes. libbase64, the C library
pybase64 bundles, decodes into any buffer: its `base64_decode` is exported by pybase64's extension module, and is
called here through ctypes (which releases the GIL for the call). Where that symbol is missing (another pybase64
build), `b64decode_into` says so and the caller decodes its usual way.
"""

from __future__ import annotations

import ctypes
from _ctypes import CFuncPtr
from functools import cache

import numpy as np
import pybase64

QUANTUM = 4  # base64 characters per 3 bytes


@cache
def _libbase64_decode() -> CFuncPtr | None:
    try:
        decode = ctypes.CDLL(pybase64._pybase64.__file__).base64_decode
    except (AttributeError, OSError):
        return None
    # int base64_decode(const char *src, size_t srclen, char *out, size_t *outlen, int flags): 1 on success
    decode.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    decode.restype = ctypes.c_int
    return decode


@cache
def _ascii_data() -> CFuncPtr:
    # For an ASCII str, CPython's UTF-8 view is the string's own storage: a pointer to it, without a copy.
    as_utf8 = ctypes.pythonapi.PyUnicode_AsUTF8AndSize
    as_utf8.argtypes = [ctypes.py_object, ctypes.POINTER(ctypes.c_ssize_t)]
    as_utf8.restype = ctypes.c_void_p
    return as_utf8


def decoded_size(text: str) -> int | None:
    """Bytes that padded base64 `text` decodes to; None when its length is not a whole number of quanta."""
    if not text or len(text) % QUANTUM:
        return None
    return len(text) // QUANTUM * 3 - (text[-2:].count("="))


def b64decode_into(text: str, out: np.ndarray) -> bool:
    """Decode strict base64 `text` into the C-contiguous `out`, which it must fill exactly. False (and `out`
    possibly half written) when it cannot: the decoder is missing, the sizes differ, or `text` is not strict base64;
    the caller then decodes with its own checks and errors."""
    decode = _libbase64_decode()
    if decode is None or not out.flags.c_contiguous or not out.flags.writeable or not text.isascii():
        return False
    if decoded_size(text) != out.nbytes:
        return False
    # All but the last quantum go straight into `out`: none of them may hold padding, so libbase64 writes exactly
    # 3 bytes per quantum and never past the buffer. The last quantum (up to 3 bytes, maybe padded) goes through
    # pybase64, which checks it strictly.
    head_chars = len(text) - QUANTUM
    head_bytes = head_chars // QUANTUM * 3
    written = ctypes.c_size_t(0)
    source = _ascii_data()(text, None)
    if head_chars and (
        decode(source, head_chars, out.ctypes.data, ctypes.byref(written), 0) != 1 or written.value != head_bytes
    ):
        return False
    try:
        tail = pybase64.b64decode(text[head_chars:], validate=True)
    except ValueError:
        return False
    out.reshape(-1).view(np.uint8)[head_bytes:] = np.frombuffer(tail, np.uint8)
    return True
