"""Command-line flags of the embedded engine: the subset of ``sglang.launch_server`` it honours.

Same spellings as SGLang, so a plan renders one argv shape for both engines. SGLang flags that do not matter
on one CPU process (``--tp-size 1``, ``--mem-fraction-static`` ...) are accepted and ignored with a log line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field

from miles_runner.core.sglang_protocol import ENGINE_BUILDS, MILES_FORK
from miles_runner.embedded_engine.validation import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_N

logger = logging.getLogger(__name__)

DEFAULT_PORT = 30000


@dataclass(frozen=True)
class LoRASpec:
    """One ``--lora-paths`` entry: ``PATH``, ``NAME=PATH`` or JSON ``{"lora_name","lora_path","pinned"}``."""

    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass
class ServerArgs:
    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    served_model_name: str | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    api_key_env: str | None = None  # not an SGLang flag: the name of an environment variable holding --api-key
    random_seed: int = 0
    context_length: int | None = None
    max_running_requests: int = 64
    weight_version: str = "default"
    enable_lora: bool = False
    lora_paths: list[LoRASpec] = field(default_factory=list)
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    enable_return_routed_experts: bool = False
    enable_cache_report: bool = False
    disable_radix_cache: bool = False  # no prefix cache: every request prefills its whole prompt
    enable_memory_saver: bool = False  # release_memory_occupation gives memory back (memory_occupation.py)
    enable_weights_cpu_backup: bool = False  # released weights are kept to restore from, not reloaded
    dist_timeout: int | None = None  # seconds; bounds weight-update group joins and broadcasts
    engine_build: str = MILES_FORK  # stock: serve as stock SGLang, without the fork-only features
    max_n: int = DEFAULT_MAX_N
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    log_level: str = "info"
    ignored_flags: list[str] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


def parse_lora_path(entry: str) -> LoRASpec:
    """Parse one ``--lora-paths`` entry the way SGLang does."""
    if entry.lstrip().startswith("{"):
        spec = json.loads(entry)
        return LoRASpec(spec["lora_name"], spec["lora_path"], bool(spec.get("pinned", False)))
    if "=" in entry:
        name, path = entry.split("=", 1)
        return LoRASpec(name, path)
    return LoRASpec(entry, entry)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an unknown SGLang flag must never be prefix-matched onto one of ours.
    p = argparse.ArgumentParser(
        prog="python -m miles_runner.embedded_engine",
        description="Embedded SGLang-compatible engine (CPU, tiny models).",
        allow_abbrev=False,
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--served-model-name")
    p.add_argument("--api-key")
    p.add_argument("--admin-api-key")
    # Not an SGLang flag: read the API key from this environment variable, so it is not in argv (which local users
    # can read in /proc/<pid>/cmdline).
    p.add_argument("--api-key-env", metavar="NAME")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--context-length", type=int)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--lora-paths", nargs="*", default=[], type=parse_lora_path)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int)
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", nargs="*")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--enable-cache-report", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-weights-cpu-backup", action="store_true")
    p.add_argument("--dist-timeout", type=int)
    # Not an SGLang flag: which SGLang build to serve as (core.sglang_protocol). The fork's features are served
    # only as miles_fork; as stock, the fork's route is a 404 and its fields are dropped, as stock SGLang does.
    p.add_argument("--engine-build", choices=ENGINE_BUILDS, default=MILES_FORK)
    # Not SGLang flags either: the most samples per prompt (n), and prompts x n, that one request may ask for.
    p.add_argument("--max-n", type=_positive_int, default=DEFAULT_MAX_N)
    p.add_argument("--max-batch-size", type=_positive_int, default=DEFAULT_MAX_BATCH_SIZE)
    p.add_argument("--log-level", default="info")
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    namespace, unknown = build_parser().parse_known_args(argv)
    args = ServerArgs(**vars(namespace), ignored_flags=unknown)
    if args.api_key_env:
        args.api_key = _key_from_env(args.api_key_env)
    if args.lora_paths:
        args.enable_lora = True  # SGLang: --lora-paths implies --enable-lora
    if args.served_model_name is not None and ":" in args.served_model_name:  # SGLang refuses it at launch too
        raise SystemExit(
            f"--served-model-name {args.served_model_name!r} cannot contain ':'; the colon is reserved for the "
            "'model:adapter' syntax of LoRA requests"
        )
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:
        raise SystemExit("--max-loaded-loras must be at least --max-loras-per-batch")
    return args


def _key_from_env(name: str) -> str:
    key = os.environ.get(name, "")
    if not key:
        raise SystemExit(f"--api-key-env {name}: the environment variable {name} is unset or empty; set it to the key")
    return key


def log_ignored_flags(args: ServerArgs) -> None:
    if args.ignored_flags:
        logger.info("ignoring SGLang flags the embedded engine does not use: %s", " ".join(args.ignored_flags))
