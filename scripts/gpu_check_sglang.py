"""GPU check: real SGLang serving the tiny MoE model, driven through the same EngineClient contract as the CPU
contract tests (miles_testkit/contract/), with LoRA, routed experts and the memory saver on; then the GPU memory one
release of every tag frees and its resume takes back.

    python scripts/gpu_check_sglang.py [--work-dir DIR] [--start-timeout-s 600] [--only CHECK ...]

Prints a JSON summary (every check with its facts or its error, and the SGLang log path); exits 0 when every
check passed, 1 when some failed, 2 when this machine cannot run it (no sglang, no CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# Tiny model (head_dim 16): the triton attention backend takes any head size; no CUDA graphs for a fast start.
SGLANG_GPU_FLAGS = [
    "--attention-backend",
    "triton",
    "--disable-cuda-graph",
    "--mem-fraction-static",
    "0.3",
    "--random-seed",
    "0",
    # As a colocated run's engines start (plan/render.py memory_flags): release_memory_occupation gives GPU memory
    # back, and the weights come back from host memory (without the backup SGLang resumes them uninitialised).
    "--enable-memory-saver",
    "--enable-weights-cpu-backup",
]
# SGLang serves a float32 checkpoint in half precision (dtype auto): two runs of one request differ slightly.
SGLANG_LOGPROB_TOL = 0.05


def missing_requirement() -> str | None:
    """Why real SGLang cannot run here, or None."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (on a GPU machine: pip install -e '.[gpu]')"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return None


def sglang_tensor_wires() -> tuple[Any, Any]:
    """MultiprocessingSerializer strings as SGLang expects them; CUDA tensors travel as IPC handles."""
    from sglang.srt.utils import MultiprocessingSerializer

    def on_gpu(tensors: Mapping[str, Any]) -> dict[str, Any]:
        return {name: tensor.cuda() for name, tensor in tensors.items()}

    def lora_wire(tensors: Mapping[str, Any]) -> str:
        return MultiprocessingSerializer.serialize(on_gpu(tensors), output_str=True)

    def weights_wire(tensors: Mapping[str, Any]) -> str:
        return MultiprocessingSerializer.serialize(list(on_gpu(tensors).items()), output_str=True)

    return lora_wire, weights_wire


async def device_memory_cycle(url: str) -> dict[str, float]:
    """The GPU memory a release of every tag frees and a resume takes again (the device's free memory, read here:
    the engine is another process)."""
    import torch

    from miles_runner.core.sglang_protocol import MEMORY_TAGS, WEIGHTS_TAG
    from miles_runner.sglang_client.client import EngineClient

    def free_mib() -> float:
        return torch.cuda.mem_get_info()[0] / 2**20

    async with EngineClient(url, timeout_s=300) as client:
        before = free_mib()
        await client.release_memory_occupation(list(MEMORY_TAGS))
        released = free_mib()
        await client.resume_memory_occupation([WEIGHTS_TAG])
        await client.resume_memory_occupation([t for t in MEMORY_TAGS if t != WEIGHTS_TAG])
        return {"released_mib": released - before, "restored_mib": released - free_mib()}


async def run_checks(url: str, model_dir: Path, adapter_path: Path, only: list[str]) -> dict[str, Any]:
    from miles_runner.core.sglang_protocol import STOCK
    from miles_runner.sglang_client.client import EngineClient
    from miles_testkit.contract import CONTRACT_ADAPTER, CONTRACT_CHECKS, ContractTarget, run_contract

    lora_wire, weights_wire = sglang_tensor_wires()
    checks = [check for check in CONTRACT_CHECKS if not only or check.__name__ in only]
    async with EngineClient(url, timeout_s=300) as client:
        target = ContractTarget(
            client,
            model_dir,
            CONTRACT_ADAPTER,
            adapter_path,
            lora_wire=lora_wire,
            weights_wire=weights_wire,
            logprob_tol=SGLANG_LOGPROB_TOL,
            build=STOCK,  # the gpu extra installs stock SGLang (core.sglang_protocol.SGLANG_VERSION)
        )
        return await run_contract(target, checks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, help="adapter and SGLang log go here (default: a temp dir)")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--only", nargs="*", default=[], help="run only these contract checks")
    args = parser.parse_args(argv)

    reason = missing_requirement()
    if reason:
        print(json.dumps({"ok": False, "skipped": reason}))
        return 2

    from miles_runner.models.tiny_model import ensure_tiny_model
    from miles_runner.procs.ports import free_port
    from miles_testkit.contract import build_contract_adapter, contract_engine_argv
    from miles_testkit.launch import engine_url, start_engine

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check_sglang-"))
    model_dir = ensure_tiny_model("tiny-moe")
    adapter = build_contract_adapter(model_dir, work / "adapter")
    port = free_port()
    argv = contract_engine_argv("sglang.launch_server", model_dir, port, adapter) + SGLANG_GPU_FLAGS
    log_path = work / "sglang.log"
    engine = start_engine(argv, port=port, log_path=log_path, timeout_s=args.start_timeout_s)
    try:
        summary = asyncio.run(run_checks(engine_url(argv, port), model_dir, adapter, args.only))
        summary["device_memory"] = asyncio.run(device_memory_cycle(engine_url(argv, port)))
    finally:
        engine.stop(timeout_s=30)
    print(json.dumps({"ok": summary["failed"] == 0, "log": str(log_path), **summary}, indent=2))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
