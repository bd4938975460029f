"""What the controller service runs with: from a saved plan (`--plan plan.yaml`) or from flags (standalone).

From a plan: the slot count, the per-adapter cap and the trainer's dp size come from its multi-LoRA and
trainer sections; the max LoRA rank and target modules are the flags its engines are started with (what
the engines can actually serve); the engines to abort on are the plan's engines; the plan's adapters are
registered at start, and their save folders default to <plan folder>/adapters/<name>. Adapters registered
over the API may read data files from the folders of the plan's own data files, the bundled prompt sets and the
run folder. Its key is the run's (`--api-key-env`, from the plan's security.api_key_env), which it also sends to
the engines and the router.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from miles_runner.config.schema import AdaptersConfig
from miles_runner.core.adapters import AdapterLimits
from miles_runner.multi_lora.config import AdapterDefaults, plan_overrides
from miles_runner.multi_lora.controller import MultiLoRAController
from miles_runner.plan.model import Plan
from miles_runner.plan.record import read_started_plan
from miles_runner.plan.secrets import secret_value
from miles_runner.plugins.lookup import registered
from miles_runner.sglang_client.engine_pool import fixed_engines, router_engines

# The standalone controller's key variable; a run's controller reads the run's (--api-key-env, from the plan's
# security.api_key_env). Only a variable's name is ever in argv: argv is visible to every local user.
TOKEN_ENV = "MILES_MULTI_LORA_API_TOKEN"
DEFAULT_PORT = 8068


@dataclass(frozen=True)
class ControllerSettings:
    defaults: AdapterDefaults
    limits: AdapterLimits
    engine_urls: tuple[str, ...] = ()
    router_url: str | None = None  # when set, the engines are whatever the router lists at abort time
    adapters: tuple[tuple[str, dict[str, Any]], ...] = ()  # registered at start, in order
    api_token: str | None = None
    adapters_dir: str | None = None  # enables POST {"yaml_path"} for files inside it

    def build_controller(self) -> MultiLoRAController:
        key = self.api_token  # the run's one key: the controller requires it, and the engines and router too
        engines = router_engines(self.router_url, api_key=key) if self.router_url else fixed_engines(self.engine_urls)
        controller = MultiLoRAController(self.defaults, self.limits, engines, api_key=key)
        for name, overrides in self.adapters:
            controller.register_adapter(name, overrides)
        return controller


def registered_plugins() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    names = registered()
    return tuple(names["task"]), tuple(names["reward"]), tuple(names["agent"])


def settings_from_plan(plan: Plan, plan_dir: Path) -> ControllerSettings:
    if plan.multi_lora is None:
        raise ValueError(f"plan {plan.name!r} has no multi-LoRA section (adapters=multi)")
    if not plan.engines:
        raise ValueError(f"plan {plan.name!r} starts no engines")
    m = plan.multi_lora
    max_rank, targets = m.max_lora_rank, tuple(m.target_modules)
    tasks, rewards, agents = registered_plugins()
    limits = AdapterLimits(
        max_slots=plan.multi_lora.slots,
        max_lora_rank=max_rank,
        target_modules=targets,
        max_adapter_global_batch_size=plan.multi_lora.max_adapter_global_batch_size,
        dp_size=plan.trainer.parallel.dp,
        tasks=tasks,
        rewards=rewards,
        agents=agents,
    )
    defaults = AdapterDefaults(
        rank=m.default_rank,
        alpha=m.default_alpha,
        target_modules=targets,
        lr=plan.optimizer.lr,
        rollout_batch_size=plan.rollout.rollout_batch_size,
        n_samples_per_prompt=plan.rollout.n_samples_per_prompt,
        task=plan.rollout.task,
        reward=plan.rollout.reward,
        save_root=str(plan_dir),
        data_roots=plan_data_roots(plan),
    )
    return ControllerSettings(
        defaults=defaults,
        limits=limits,
        engine_urls=tuple(engine.launch.url for engine in plan.engines),
        adapters=tuple((adapter.name, plan_overrides(adapter)) for adapter in plan.adapters),
    )


def plan_data_roots(plan: Plan) -> tuple[str, ...]:
    """The folders of the data files the plan names: an adapter registered at run time may read from them too."""
    files = [plan.rollout.data, *(adapter.data for adapter in plan.adapters)]
    return tuple(sorted({str(Path(file).parent) for file in files if file}))


def settings_from_flags(args: argparse.Namespace) -> ControllerSettings:
    tasks, rewards, agents = registered_plugins()
    targets = tuple(args.target_modules)
    limits = AdapterLimits(
        max_slots=args.max_slots,
        max_lora_rank=args.max_lora_rank,
        target_modules=targets,
        max_adapter_global_batch_size=args.max_adapter_global_batch_size,
        dp_size=args.dp_size,
        tasks=tasks,
        rewards=rewards,
        agents=agents,
    )
    defaults = AdapterDefaults(
        rank=args.lora_rank or args.max_lora_rank,
        alpha=args.lora_alpha,
        target_modules=targets,
        lr=args.lr,
        rollout_batch_size=args.rollout_batch_size,
        n_samples_per_prompt=args.n_samples_per_prompt,
        task=args.task,
        reward=args.reward,
        save_root=args.save_root,
        data_roots=tuple(args.data_root),
    )
    return ControllerSettings(
        defaults=defaults, limits=limits, engine_urls=tuple(args.engine_urls), router_url=args.router_url
    )


def load_settings(args: argparse.Namespace) -> ControllerSettings:
    if args.plan:
        plan_path = Path(args.plan).resolve()
        settings = settings_from_plan(read_started_plan(plan_path), plan_path.parent)
    else:
        settings = settings_from_flags(args)
    return replace(settings, api_token=api_token(args), adapters_dir=args.adapters_dir)


def api_token(args: argparse.Namespace) -> str | None:
    """The key from the variable --api-key-env names (a plan's controller: the run's; standalone: TOKEN_ENV by
    default). A named variable that is unset or empty is an error: the service never starts open by mistake."""
    if args.api_key_env:
        return secret_value(args.api_key_env)
    return None if args.plan else os.environ.get(TOKEN_ENV) or None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m miles_runner.multi_lora.http_server",
        description="The multi-LoRA controller service: adapter registry, abort fan-out and HTTP API.",
        allow_abbrev=False,
    )
    p.add_argument("--plan", help="a saved plan.yaml: every setting below comes from it")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument(
        "--api-key-env",
        help=f"require the bearer key held by this environment variable (standalone "
        f"default: {TOKEN_ENV}, if set); it is also sent to the engines",
        metavar="NAME",
    )
    p.add_argument("--adapters-dir", help="allow POST /adapter_runs {'yaml_path'} for files inside this folder")
    p.add_argument("--log-level", default="warning")
    standalone = p.add_argument_group("standalone (without --plan)")
    standalone.add_argument("--max-slots", type=int)
    standalone.add_argument("--max-lora-rank", type=int)
    standalone.add_argument("--target-modules", nargs="+")
    standalone.add_argument("--engine-urls", nargs="*", default=[])
    standalone.add_argument("--router-url")
    standalone.add_argument("--max-adapter-global-batch-size", type=int, default=1 << 16)
    standalone.add_argument("--dp-size", type=int, default=1)
    standalone.add_argument("--save-root", default=".", help="adapters save inside <save-root>/adapters")
    standalone.add_argument(
        "--data-root",
        action="append",
        default=[],
        help="a folder adapters may read data files from (repeatable; also: bundled, save root)",
    )
    standalone.add_argument("--lora-rank", type=int, help="default rank (else the max rank)")
    standalone.add_argument("--lora-alpha", type=float, default=AdaptersConfig.alpha)
    standalone.add_argument("--lr", type=float, default=1e-3)
    standalone.add_argument("--rollout-batch-size", type=int, default=8)
    standalone.add_argument("--n-samples-per-prompt", type=int, default=4)
    standalone.add_argument("--task", default="arith")
    standalone.add_argument("--reward", default="exact_match")
    args = p.parse_args(argv)
    if not args.plan:
        missing = [f for f in ("max_slots", "max_lora_rank", "target_modules") if getattr(args, f) is None]
        if missing:
            p.error("without --plan, these are required: " + ", ".join("--" + f.replace("_", "-") for f in missing))
    return args
