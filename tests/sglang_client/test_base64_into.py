"""sglang_client/base64_into.py: strict base64 decoded straight into a caller's buffer, or a clear False."""

import os

import numpy as np
import pybase64
import pytest

from miles_runner.sglang_client.base64_into import b64decode_into, decoded_size


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 7, 100, 1536 * 7, 1_000_003])
def test_every_padding_decodes_into_the_buffer_byte_for_byte(size):
    data = os.urandom(size)
    out = np.zeros(size, np.uint8)
    assert b64decode_into(pybase64.b64encode_as_string(data), out)
    assert out.tobytes() == data


def test_routing_rows_decode_into_a_slice_of_a_larger_tensor():
    rows = np.random.default_rng(0).integers(0, 128, (5, 3, 8), dtype=np.int32)
    merged = np.zeros((9, 3, 8), np.int32)
    assert b64decode_into(pybase64.b64encode_as_string(rows), merged[2:7])
    assert np.array_equal(merged[2:7], rows) and not merged[:2].any() and not merged[7:].any()


def test_this_pybase64_build_exports_the_decoder():
    # Without it every R3 merge would fall back to decode-then-copy (half the speed): fail loudly here instead.
    from miles_runner.sglang_client.base64_into import _libbase64_decode

    assert _libbase64_decode() is not None


def text_of(size: int) -> str:
    return pybase64.b64encode_as_string(os.urandom(size))


@pytest.mark.parametrize(
    "text, size",
    [
        (text_of(300), 301),  # the buffer is larger than the payload
        (text_of(300), 299),  # and smaller: nothing is written past it
        (text_of(300)[:-1], 300),  # not a whole number of quanta
        ("", 0),
        (text_of(300)[:10] + "!" + text_of(300)[11:], 300),  # outside the alphabet, in the bulk
        (text_of(300)[:-1] + "!", 300),  # and in the last quantum
        (text_of(4) + text_of(5), 11),  # padding in the middle
        ("é" * 400, 300),  # not ASCII
    ],
    ids=["larger", "smaller", "ragged", "empty", "bad-bulk", "bad-tail", "inner-padding", "non-ascii"],
)
def test_what_it_cannot_decode_exactly_is_refused(text, size):
    out = np.zeros(size + 16, np.uint8)  # a guard band after the buffer, which must stay untouched
    assert not b64decode_into(text, out[:size])
    assert not out[size:].any()


def test_a_buffer_it_cannot_write_in_place_is_refused():
    data = os.urandom(96)
    text = pybase64.b64encode_as_string(data)
    strided = np.zeros(192, np.uint8)[::2]
    assert not b64decode_into(text, strided)
    frozen = np.zeros(96, np.uint8)
    frozen.flags.writeable = False
    assert not b64decode_into(text, frozen)


def test_decoded_size_counts_padding():
    assert [decoded_size(pybase64.b64encode_as_string(b"x" * n)) for n in (1, 2, 3, 4)] == [1, 2, 3, 4]
    assert decoded_size("abc") is None and decoded_size("") is None
