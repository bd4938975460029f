"""Shared-memory tensor hand-off (sglang_client/tensor_shm.py): the segment is a safetensors file both ways, the
engine's tensors are its own, and a handle reaches nothing but this user's segments."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pybase64
import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_runner.sglang_client import tensor_shm
from miles_runner.sglang_client.tensor_shm import SHM_DIR, SharedTensors, TensorSegment, on_this_host, read_segment
from miles_runner.sglang_client.tensor_wire import deserialize_named_tensors, serialize_named_tensors

pytestmark = pytest.mark.skipif(not tensor_shm.shared_memory_available(), reason="no /dev/shm on this host")


def mixed() -> dict[str, torch.Tensor]:
    """Every dtype kind, odd sizes (a bool before an int64 leaves the int64 unaligned), a scalar, an empty one."""
    torch.manual_seed(0)
    return {
        "w": torch.randn(3, 5),
        "flag": torch.tensor([True, False, True]),
        "ids": torch.arange(7),
        "half": torch.randn(4).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "small": torch.tensor([-3, 4], dtype=torch.int8),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape and torch.equal(got[key], tensor)


@pytest.fixture()
def segment():
    made = TensorSegment()
    yield made
    made.close()


def test_a_handle_entry_reads_back_every_tensor(segment):
    tensors = mixed()
    entry = pybase64.b64encode_as_string(segment.write(tensors.items()))
    assert len(entry) < 100  # a handle, not the bytes
    assert_same(deserialize_named_tensors(entry), tensors)


def test_the_segment_is_a_safetensors_file_that_safetensors_reads(segment):
    tensors = mixed()
    segment.write(tensors.items())
    assert_same(load_file(segment.path), tensors)
    header_size = int.from_bytes(segment.path.read_bytes()[:8], "little")
    assert header_size % 8 == 0  # padded, as safetensors writes it


def test_a_file_safetensors_wrote_reads_back(tmp_path):
    tensors = mixed()
    name = f"miles-tensors-{os.getpid()}-{'0' * 16}"
    save_file(tensors, SHM_DIR / name)
    try:
        assert_same(read_segment(name), tensors)
    finally:
        (SHM_DIR / name).unlink()


def test_the_engines_tensors_do_not_change_when_the_trainer_rewrites_the_segment(segment):
    first = {"w": torch.ones(64, 64), "b": torch.arange(10)}
    handle = pybase64.b64encode_as_string(segment.write(first.items()))
    received = deserialize_named_tensors(handle)
    segment.write({"w": torch.zeros(64, 64), "b": torch.zeros(10, dtype=torch.int64)}.items())
    assert_same(received, first)


def test_a_rewrite_of_other_sizes_resizes_the_segment(segment):
    segment.write({"big": torch.randn(1000)}.items())
    small = {"small": torch.randn(3)}
    segment.write(small.items())
    assert_same(read_segment(segment.name), small)
    header_size = int.from_bytes(segment.path.read_bytes()[:8], "little")
    assert segment.path.stat().st_size == 8 + header_size + 12  # the file ends where its data ends


def test_close_removes_the_segment():
    made = TensorSegment()
    made.write({"a": torch.ones(2)}.items())
    assert made.path.exists()
    made.close()
    assert not made.path.exists()
    with pytest.raises(ValueError, match="cannot be opened here"):
        read_segment(made.name)


def test_segments_of_dead_processes_are_removed_and_live_ones_kept():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = SHM_DIR / f"miles-tensors-{int(gone.stdout)}-{'a' * 16}"
    orphan.write_bytes(b"left by a killed trainer")
    live = TensorSegment()
    try:
        TensorSegment().close()  # a new segment sweeps the orphans
        assert not orphan.exists() and live.path.exists()
    finally:
        orphan.unlink(missing_ok=True)
        live.close()


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "/etc/passwd", "miles-tensors-1-abc", "other-1-0000000000000000", ""]
)
def test_a_handle_naming_anything_but_a_segment_is_refused(name):
    with pytest.raises(ValueError, match="not a tensor segment name"):
        read_segment(name)


def test_a_symlink_named_like_a_segment_is_not_followed(tmp_path):
    target = tmp_path / "weights.safetensors"
    save_file({"a": torch.ones(2)}, target)
    link = SHM_DIR / f"miles-tensors-{os.getpid()}-{'b' * 16}"
    link.symlink_to(target)
    try:
        with pytest.raises(ValueError, match="cannot be opened here"):
            read_segment(link.name)
    finally:
        link.unlink()


def malformed_files() -> dict[str, bytes]:
    def file_of(header: dict, data: bytes) -> bytes:
        raw = json.dumps(header).encode()
        return len(raw).to_bytes(8, "little") + raw + data

    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    return {
        "header past the end": (10**6).to_bytes(8, "little") + b"{}",
        "not json": (4).to_bytes(8, "little") + b"{{{{",
        "data past the end": file_of({"a": entry}, b"\0" * 4),
        "shape and offsets disagree": file_of({"a": {**entry, "shape": [3]}}, b"\0" * 12),
        "negative offset": file_of({"a": {**entry, "data_offsets": [-4, 4]}}, b"\0" * 8),
        "unknown dtype": file_of({"a": {**entry, "dtype": "C64"}}, b"\0" * 8),
        "too short": b"\1\0",
    }


@pytest.mark.parametrize("kind", list(malformed_files()))
def test_a_malformed_segment_is_a_clear_error(kind):
    path = SHM_DIR / f"miles-tensors-{os.getpid()}-{'c' * 16}"
    path.write_bytes(malformed_files()[kind])
    try:
        with pytest.raises(ValueError, match="not a well-formed safetensors file"):
            read_segment(path.name)
    finally:
        path.unlink()


def test_inline_entries_still_read_as_safetensors():
    tensors = mixed()
    assert_same(deserialize_named_tensors(serialize_named_tensors(tensors)), tensors)


@pytest.mark.parametrize(
    ("url", "local"),
    [
        ("http://127.0.0.1:30000", True),
        ("http://127.0.0.5:1", True),
        ("http://localhost:8000/", True),
        ("http://[::1]:9000", True),
        ("http://10.0.0.2:30000", False),
        ("http://node-3:30000", False),
    ],
)
def test_only_loopback_engines_count_as_on_this_host(url, local):
    assert on_this_host(url) is local


def test_a_reader_maps_a_segment_once_and_again_when_it_is_resized(segment):
    from miles_runner.sglang_client.tensor_shm import SegmentReader

    reader = SegmentReader()
    try:
        segment.write({"w": torch.ones(8)}.items())
        with reader.borrow(segment.name) as tensors:
            assert torch.equal(tensors["w"], torch.ones(8))
        mapped = reader._map
        segment.write({"w": torch.full((8,), 3.0)}.items())  # same size: read through the same map
        with reader.borrow(segment.name) as tensors:
            assert torch.equal(tensors["w"], torch.full((8,), 3.0)) and reader._map is mapped
        segment.write({"w": torch.zeros(16), "b": torch.arange(3)}.items())  # resized: mapped again
        with reader.borrow(segment.name) as tensors:
            assert_same(tensors, {"w": torch.zeros(16), "b": torch.arange(3)})
            assert reader._map is not mapped
    finally:
        reader.close()


def test_a_reader_refuses_what_read_segment_refuses(tmp_path):
    from miles_runner.sglang_client.tensor_shm import SegmentReader

    reader = SegmentReader()
    empty = SHM_DIR / f"miles-tensors-{os.getpid()}-{'d' * 16}"
    empty.write_bytes(b"")
    try:
        for name, why in [
            ("../x", "not a tensor segment name"),
            (empty.name, "not a well-formed"),
            (f"miles-tensors-1-{'e' * 16}", "cannot be opened here"),
        ]:
            with pytest.raises(ValueError, match=why), reader.borrow(name):
                pass
    finally:
        empty.unlink()
        reader.close()


def test_a_dtype_without_a_safetensors_name_is_refused_before_anything_is_written(segment):
    kept = {"w": torch.ones(4)}
    segment.write(kept.items())
    with pytest.raises(TypeError, match="send these tensors inline"):
        segment.write({"w": torch.ones(4), "z": torch.ones(2, dtype=torch.complex64)}.items())
    assert_same(read_segment(segment.name), kept)


# ----- SharedTensors: tensors whose memory is the segment (a trainer's adapter parameters) -----


def adapter_like() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        "a.lora_A.weight": torch.randn(4, 16),
        "a.lora_B.weight": torch.randn(16, 4),
        "b.lora_A.weight": torch.randn(4, 16),
    }


def test_shared_tensors_hold_the_values_and_what_changes_in_them_is_what_an_engine_reads():
    given = adapter_like()
    shared = SharedTensors(given)
    try:
        assert_same(shared.tensors, given)
        assert all(shared.tensors[k].data_ptr() != given[k].data_ptr() for k in given)  # moved: memory of its own
        shared.tensors["a.lora_B.weight"].mul_(2)  # an optimizer step, in place
        read = read_segment(tensor_shm.handle_segment_name(shared.handle))
        assert torch.equal(read["a.lora_B.weight"], given["a.lora_B.weight"] * 2)
        assert torch.equal(read["a.lora_A.weight"], given["a.lora_A.weight"])
    finally:
        shared.close()


def test_only_the_shared_tensors_themselves_get_the_handle():
    shared = SharedTensors(adapter_like())
    views = shared.tensors
    try:
        assert shared.handle_for(dict(views)) == shared.handle
        assert shared.handle_for({k: v.detach() for k, v in views.items()}) == shared.handle  # same memory
        copies = {k: v.clone() for k, v in views.items()}
        assert shared.handle_for(copies) is None
        assert shared.handle_for({k: v for k, v in views.items() if k != "b.lora_A.weight"}) is None
        assert shared.handle_for({**views, "b.lora_A.weight": views["a.lora_A.weight"]}) is None  # another's memory
        square = SharedTensors({"sq": torch.randn(8, 8)})
        try:
            assert square.handle_for({"sq": square.tensors["sq"].t()}) is None  # same memory, other layout
        finally:
            square.close()
    finally:
        shared.close()
    assert shared.handle_for(dict(views)) is None  # closed: its segment is gone


def test_closing_removes_the_segment_and_the_tensors_keep_their_memory():
    shared = SharedTensors(adapter_like())
    path, views = shared._segment.path, shared.tensors
    shared.close()
    del shared
    assert not path.exists()
    views["a.lora_A.weight"].add_(1)  # still mapped: a closed map under them would crash here
    assert torch.allclose(views["a.lora_A.weight"] - 1, adapter_like()["a.lora_A.weight"])


def test_tensors_that_cannot_all_be_laid_out_in_place_are_refused_and_leave_no_segment():
    before = set(SHM_DIR.glob(f"miles-tensors-{os.getpid()}-*"))
    with pytest.raises(ValueError, match="cannot all be laid out in shared memory"):
        SharedTensors({"flag": torch.tensor([True]), "w": torch.randn(3)})  # the float32 would start unaligned
    assert set(SHM_DIR.glob(f"miles-tensors-{os.getpid()}-*")) == before


def test_a_reader_keeps_the_views_of_an_unchanged_header_and_parses_a_changed_one(segment):
    from miles_runner.sglang_client.tensor_shm import SegmentReader

    reader = SegmentReader()
    try:
        segment.write({"w": torch.ones(8), "b": torch.zeros(2)}.items())
        with reader.borrow(segment.name) as tensors:
            first = tensors["w"]
        segment.write({"w": torch.full((8,), 5.0), "b": torch.ones(2)}.items())  # new values, same header
        with reader.borrow(segment.name) as tensors:
            assert tensors["w"] is first and torch.equal(tensors["w"], torch.full((8,), 5.0))
        segment.write({"b": torch.full((2,), 7.0), "w": torch.ones(8)}.items())  # same size, other layout
        with reader.borrow(segment.name) as tensors:
            assert tensors["w"] is not first
            assert_same(tensors, {"b": torch.full((2,), 7.0), "w": torch.ones(8)})
        unaligned = {"flag": torch.tensor([True, False, True]), "w": torch.arange(6, dtype=torch.float32)}
        segment.write(unaligned.items())
        with reader.borrow(segment.name) as tensors:
            assert_same(tensors, unaligned)
        unaligned["w"] += 1
        segment.write(unaligned.items())  # the same header: the copy made for the unaligned tensor is not kept
        with reader.borrow(segment.name) as tensors:
            assert_same(tensors, unaligned)
    finally:
        reader.close()
