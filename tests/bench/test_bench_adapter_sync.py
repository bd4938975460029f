"""bench/adapter_sync_bandwidth.py's accounting: the bytes it reports are the adapter's real tensor bytes, and its
bandwidth figures follow from its seconds (run with `python -m pytest` from the repository root, as make does)."""

from __future__ import annotations

import pytest

from bench import adapter_sync_bandwidth as bench

pytestmark = pytest.mark.integration

QWEN = bench.QWEN25_05B_SHAPE
HEAD_DIM = QWEN["hidden_size"] // QWEN["num_attention_heads"]


def lora_bytes(rank: int) -> int:
    """float32 LoRA on every linear layer: A is (r, in), B is (out, r) for each of the 7 projections per layer."""
    hidden, inter, kv = QWEN["hidden_size"], QWEN["intermediate_size"], QWEN["num_key_value_heads"] * HEAD_DIM
    in_out = [
        (hidden, hidden),
        (hidden, kv),
        (hidden, kv),
        (hidden, hidden),
        (hidden, inter),
        (hidden, inter),
        (inter, hidden),
    ]
    return 4 * rank * bench.NUM_LAYERS * sum(i + o for i, o in in_out)


@pytest.fixture(scope="module")
def model_dir():
    return bench.ensure_model()


def test_the_model_has_the_qwen_shape(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.num_hidden_layers,
    ) == (896, 4864, 14, 2, bench.NUM_LAYERS)


@pytest.mark.parametrize("rank", bench.RANKS)
def test_reported_bytes_are_the_adapters_tensor_bytes(model_dir, rank):
    from miles_runner.weight_sync.adapter_sync import tensor_bytes

    tensors, config = bench.make_adapter(model_dir, rank)
    assert config["r"] == rank and sorted(config["target_modules"]) == sorted(bench.TARGETS)
    assert len(tensors) == 2 * 7 * bench.NUM_LAYERS
    assert tensor_bytes(tensors) == lora_bytes(rank)


def path_seconds(fixed: float, rate: float, nbytes: int, fixed_min: float) -> dict[str, float]:
    """Median seconds of `fixed` + bytes / rate, and fastest runs with their own fixed part."""
    push, load = nbytes / rate, nbytes / (2 * rate)
    return {
        "push_seconds": fixed + push,
        "load_seconds": fixed / 2 + load,
        "push_min_seconds": fixed_min + push,
        "load_min_seconds": fixed_min + load,
    }


def measured_rows() -> list[dict]:
    """Copies at 4 GB/s (fastest runs: 1 us of fixed cost, then 5 GB/s); paths of known fixed costs and rates."""
    return [
        {
            "rank": r,
            "bytes": b,
            "copy_seconds": b / 4e9,
            "copy_min_seconds": 1e-6 + b / 5e9,
            "tensor": path_seconds(0.01, 1e9, b, 0.005),
            "tensor_copied": path_seconds(0.01, 5e8, b, 0.005),
            "tensor_inline": path_seconds(0.03, 1e8, b, 0.02),
            "broadcast": path_seconds(0.02, 4e9, b, 0.001),
        }
        for r, b in ((8, 1_000_000), (16, 2_000_000), (64, 8_000_000))
    ]


def test_bandwidths_follow_from_the_seconds():
    rows = measured_rows()
    figures = {"rows": rows, "memory_copy_gbs": 2.0}
    bench.add_bandwidths(figures)
    assert rows[0]["copy_gbs"] == pytest.approx(4.0)
    assert rows[2]["tensor"]["load_gbs"] == pytest.approx(8e6 / (0.005 + 8e6 / 2e9) / 1e9)
    assert figures["copy_marginal_gbs"] == pytest.approx(5.0)  # the copy's slope: its fixed microsecond left out
    marginal = figures["marginal"]  # the slope leaves the fixed per-request seconds out
    assert marginal["tensor_push"]["gbs"] == pytest.approx(1.0)
    assert marginal["broadcast_load"]["gbs"] == pytest.approx(8.0)
    assert marginal["broadcast_load"]["fraction_of_copy"] == pytest.approx(8.0 / 5.0)  # slope against slope
    assert marginal["broadcast_load"]["fraction_of_memory_copy"] == pytest.approx(4.0)


def test_the_target_is_judged_on_the_loads_slope_against_the_copys():
    figures = {"rows": measured_rows(), "memory_copy_gbs": 2.0}
    bench.add_bandwidths(figures)
    verdict = bench.target_verdict(figures)  # load slopes: tensor 2, copied 1, inline 0.2, broadcast 8 GB/s
    assert "tensor met (40.0%" in verdict and "tensor_copied missed (20.0%" in verdict
    assert "tensor_inline missed (4.0%" in verdict and "broadcast met (160.0%" in verdict


def test_seconds_that_do_not_rise_with_the_bytes_give_no_marginal_bandwidth():
    assert bench.marginal_bandwidth([1, 2, 8], [0.3, 0.2, 0.1]) is None
    assert bench.marginal_bandwidth([1, 2, 8], [0.1, 0.1, 0.1]) is None
    assert bench.marginal_bandwidth([1_000, 2_000, 8_000], [1.0, 2.0, 8.0]) == pytest.approx(1_000)
