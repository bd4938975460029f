"""The commands that start each real component, rendered from the config and its derived values.

The SGLang engine and the embedded CPU engine take one argv shape (the embedded engine accepts SGLang's flags
and ignores the GPU-only ones), so the plan differs between them only in the module it runs.
"""

from __future__ import annotations

from typing import NamedTuple

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived, absolute_path
from miles_runner.plan.model import Launch
from miles_runner.plan.secrets import secret_placeholder

PYTHON = "python"  # the local executor substitutes the run's interpreter
ENGINE_MODULES = {"sglang": "sglang.launch_server", "embedded": "miles_runner.embedded_engine"}


class NodeRank(NamedTuple):
    """Where one launch of an SGLang engine wider than a node stands: every node runs the same command with its
    own --node-rank; all of them meet at rank 0's node, `dist_init_addr` (host:port)."""

    nnodes: int
    rank: int
    dist_init_addr: str


def engine_argv(
    cfg: MilesConfig, d: Derived, *, host: str, port: int | str, node_rank: NodeRank | None = None
) -> list[str]:
    e = cfg.engine
    argv = [PYTHON, "-m", ENGINE_MODULES[e.kind], "--model-path", d.model_path, "--host", host, "--port", str(port)]
    argv += ["--served-model-name", cfg.model.name]  # what /v1/models and /model_info call the base model
    argv += ["--tp-size", str(e.tp_size), "--random-seed", str(cfg.run.seed)]
    argv += ["--context-length", str(cfg.model.max_context_len)]
    if e.ep_size > 1:
        argv += ["--ep-size", str(e.ep_size)]
    if e.kind == "sglang":
        argv += ["--mem-fraction-static", str(e.mem_fraction_static)]
        if e.dp_attention:
            argv += ["--enable-dp-attention", "--dp-size", str(e.tp_size)]
        if not e.enable_cuda_graph:
            argv.append("--disable-cuda-graph")
        if e.fp8_rollout:  # an FP8 base for rollout; the trainer and the adapter stay in bf16 (docs/system.md §3.3)
            argv += ["--quantization", "fp8"]
        if node_rank:
            argv += [
                "--nnodes",
                str(node_rank.nnodes),
                "--node-rank",
                str(node_rank.rank),
                "--dist-init-addr",
                node_rank.dist_init_addr,
            ]
    else:  # the embedded engine serves as the plan's SGLang build (an SGLang engine is whichever is installed)
        argv += ["--engine-build", e.build, "--max-n", str(e.max_n), "--max-batch-size", str(e.max_batch_size)]
    argv += memory_flags(cfg, d)
    if d.lora_rollout_enabled:
        argv += lora_flags(cfg, d)
    if cfg.rollout.routing_replay:
        argv.append("--enable-return-routed-experts")
    return argv + engine_key_flags(e.kind, cfg.security.api_key_env) + list(e.extra_args)


def memory_flags(cfg: MilesConfig, d: Derived) -> list[str]:
    """The same on both engine kinds (the embedded engine gives host memory back: memory_occupation.py): the memory
    saver under rollout offload; the base's CPU backup with LoRA in rollout, colocated engines and the flag
    (docs/system.md §3.2), which spares the resume a reload of the base."""
    flags = ["--enable-memory-saver"] if d.offload_rollout else []
    if cfg.adapters.base_cpu_backup and d.lora_rollout_enabled and d.colocated:
        flags.append("--enable-weights-cpu-backup")
    return flags


def engine_key_flags(kind: str, api_key_env: str) -> list[str]:
    """SGLang takes its key only as `--api-key VALUE`; the embedded engine reads it from the variable itself, so
    its command line (visible to every local user) holds only the name."""
    return key_flags("--api-key", api_key_env) if kind == "sglang" else key_env_flags(api_key_env)


def key_flags(flag: str, api_key_env: str) -> list[str]:
    """The run's key for a server that takes it only in argv (SGLang, the router): a placeholder the executor
    fills at spawn time (plan/secrets.py), so plan.yaml holds the variable's name, never the key."""
    return [flag, secret_placeholder(api_key_env)] if api_key_env else []


def key_env_flags(api_key_env: str) -> list[str]:
    """The run's key for our own servers: the variable's name; they read the key from their environment."""
    return ["--api-key-env", api_key_env] if api_key_env else []


def lora_flags(cfg: MilesConfig, d: Derived) -> list[str]:
    """docs/system.md §3.2: max_loras_per_batch is 1 for a single adapter and the slot count for multi-LoRA."""
    flags = ["--enable-lora", "--max-lora-rank", str(d.max_lora_rank)]
    flags += ["--max-loras-per-batch", str(max(len(d.engine_lora_names), 1))]
    flags += ["--lora-target-modules", *d.target_modules]
    if cfg.engine.kind == "sglang":
        flags += ["--lora-backend", cfg.engine.lora_backend]
    if cfg.adapters.kind == "single" and cfg.adapters.path:
        flags += ["--lora-paths", f"{d.engine_lora_names[0]}={absolute_path(cfg.adapters.path)}"]
    return flags


def router_argv(
    host: str, port: int | str, policy: str, worker_urls: list[str], *, metrics_port: int | str, api_key_env: str = ""
) -> list[str]:
    """The real sglang-router's command line; its metrics exporter binds `host` too (default is 0.0.0.0). With
    the run's key, sglang-router 0.3.2 sends it to its workers and requires it on every route but /health."""
    return [
        "sglang-router",
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        *key_flags("--api-key", api_key_env),
    ]


def session_argv(
    cfg: MilesConfig,
    d: Derived,
    *,
    host: str,
    port: int | str,
    router_url: str | None,
    engine_urls: list[str],
    lora_name: str | None,
) -> list[str]:
    s = cfg.session
    # Each session is pinned to one of the router's workers, else of every engine (session/upstream.py).
    upstream = ["--router-url", router_url] if router_url else [a for url in engine_urls for a in ("--engine-url", url)]
    argv = [PYTHON, "-m", "miles_runner.session.server", *upstream, "--model-path", d.model_path]
    argv += ["--host", host, "--port", str(port), "--version", s.version]
    argv += ["--max-trim-tokens", str(s.max_trim_tokens), "--upstream-timeout", str(s.upstream_timeout_s)]
    argv += ["--tito-model", s.tito_model, "--message-matcher", s.message_matcher]
    argv += ["--max-sessions", str(s.max_sessions), "--max-age", str(s.max_age_s)]
    if lora_name:
        argv += ["--lora-name", lora_name]
    if cfg.rollout.routing_replay:
        argv.append("--routed-experts")
    if d.use_addition_r3:
        argv.append("--addition-r3")
    return argv + key_env_flags(cfg.security.api_key_env)  # its own key and its engines' (the run's one key)


def trainer_argv(cfg: MilesConfig, d: Derived) -> list[str]:
    """The driver, run in the run folder on plan node 0: trainer rank 0 itself; ranks 1..N-1 start as
    `trainer_rank_argv` where plan.trainer.placements puts them (on node 0 by the driver, on another node by
    that node's agent)."""
    return [PYTHON, "-m", "miles_runner.loops.run", "."]


TRAINER_SOCKET = "{trainer_socket}"  # filled in at start: the driver's private socket (trainer/host.py)


def trainer_host_argv(python: str) -> list[str]:
    """Rank 0 of the trainer in the interpreter `trainer.python` names (a path made absolute: the plan runs from
    the run folder; a bare name is looked up on PATH); it connects to the driver, which then calls it for every
    train, export and checkpoint."""
    interpreter = absolute_path(python) if "/" in python else python
    return [interpreter, "-m", "miles_runner.trainer.host", ".", "--connect", TRAINER_SOCKET]


def trainer_rank_launch(run_dir: str, rank: int, device: int, master_address: str, master_port: int) -> Launch:
    """A follower trainer rank on device `device` of its node: it reads RUN_DIR/plan.yaml (a folder every node
    shares) and joins rank 0's group at master_address:master_port. It serves nothing (no health check)."""
    argv = [
        PYTHON,
        "-m",
        "miles_runner.trainer.ranks",
        run_dir,
        "--rank",
        str(rank),
        "--master-address",
        master_address,
        "--master-port",
        str(master_port),
    ]
    return Launch(argv, env={"LOCAL_RANK": str(device)}, health_path="")


def controller_argv(host: str, port: int | str, api_key_env: str = "") -> list[str]:
    """The multi-LoRA controller service; it requires the run's key (and sends it to the engines it aborts on)."""
    return [
        PYTHON,
        "-m",
        "miles_runner.multi_lora.http_server",
        "--plan",
        "plan.yaml",
        "--host",
        host,
        "--port",
        str(port),
        *key_env_flags(api_key_env),
    ]
