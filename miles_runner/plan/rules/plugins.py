"""Plug-ins are named by registered name only (a config never names code to import): every task, reward and
agent a run uses is registered, and a task that reads prompts has a data file that exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from miles_runner.config.loader import did_you_mean
from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import BUNDLED_DATA, BUNDLED_SCHEME, Derived, resolve_data_path
from miles_runner.plan.rules.base import Finding, rule
from miles_runner.plugins.lookup import registered
from miles_runner.plugins.tasks import TASKS


def _plugin_uses(cfg: MilesConfig, d: Derived) -> list[tuple[str, str, str]]:
    uses = [("rollout.task", cfg.rollout.task, "task"), ("rollout.reward", cfg.rollout.reward, "reward")]
    if cfg.session.version != "off":
        uses.append(("rollout.agent", cfg.rollout.agent, "agent"))
    if d.multi_lora:
        for i, run in enumerate(cfg.adapters.runs):
            item = f"adapters.runs[{i}]"
            uses += [(f"{item}.task", run.task, "task"), (f"{item}.reward", run.reward, "reward")]
            if run.agent is not None:
                uses.append((f"{item}.agent", run.agent, "agent"))
    return uses


@rule("plugins-registered")
def plugins_registered(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    names = registered()
    for key, value, kind in _plugin_uses(cfg, d):
        if value not in names[kind]:
            known = ", ".join(names[kind])
            hint = did_you_mean(value, names[kind])
            fix_key = key if "[" not in key else "++" + key.replace("[", ".").replace("]", "")
            yield Finding(
                (key,),
                f"No {kind} is registered as '{value}'{'; ' + hint if hint else ''} (registered: {known}).",
                f"{fix_key}={hint.split(chr(39))[1] if hint else names[kind][0]}",
            )


@rule("dataset-task-needs-data")
def dataset_task_needs_data(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    def needs_data(task: str) -> bool:
        return task in TASKS and TASKS.get(task).needs_data

    if needs_data(cfg.rollout.task) and not cfg.rollout.data:
        yield Finding(
            ("rollout.task", "rollout.data"),
            f"Task {cfg.rollout.task} reads its prompts from a file.",
            "rollout.data=/path/to/prompts.jsonl",
        )
    for i, run in enumerate(cfg.adapters.runs if d.multi_lora else []):
        if needs_data(run.task) and not run.data:
            yield Finding(
                (f"adapters.runs[{i}].task", f"adapters.runs[{i}].data"),
                f"Adapter '{run.name}' task {run.task} reads its prompts from a file.",
                f"++adapters.runs.{i}.data=/path/to/prompts.jsonl",
            )
    named = [("rollout.data", "rollout.data", cfg.rollout.data)]
    named += [
        (f"adapters.runs[{i}].data", f"++adapters.runs.{i}.data", run.data)
        for i, run in enumerate(cfg.adapters.runs if d.multi_lora else [])
    ]
    for key, override, path in named:
        if path.startswith(BUNDLED_SCHEME) and not Path(resolve_data_path(path)).is_file():
            shipped = sorted(f.name for f in BUNDLED_DATA.glob("*.jsonl"))
            yield Finding(
                (key,),
                f"No prompt set {path.removeprefix(BUNDLED_SCHEME)!r} is bundled; the package ships {shipped}.",
                f"{override}={BUNDLED_SCHEME}{shipped[0]}",
            )
