"""Hydra instantiates classes named in its own config node: callbacks (`hydra.callbacks.*._target_`), the sweeper
and launcher (`_target_`) and the logging handlers (`class`/`()` in `hydra.job_logging`, `hydra.hydra_logging`).
A config file (a recipe, a user config folder) could name any importable class there, and a sweep would create
it, even under `--plan`. miles-run instantiates nothing named by a config: callbacks are refused, the sweeper
and launcher must be Hydra plugins installed in this environment, and the logging settings must be the shipped
ones. (The same settings on the command line are refused earlier, by hydra_settings.)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from omegaconf import OmegaConf

from miles_runner.core.errors import Problem

LOGGING_NODES = ("job_logging", "hydra_logging")
FROM_CONFIG = "a config file"


def instantiation_problems(hydra_node: Any, shipped: Callable[[], Any]) -> list[Problem]:
    """A problem for each class a config file would have Hydra create; `shipped()` is the shipped config's
    `hydra` node (composed without user folders or recipes), to compare the logging settings against."""
    problems = []
    callbacks = _container(hydra_node.get("callbacks")) or {}
    if callbacks:
        names = ", ".join(sorted(callbacks))
        problems.append(
            Problem(
                "hydra-callbacks-refused",
                [(f"hydra.callbacks.{name}", FROM_CONFIG) for name in sorted(callbacks)],
                f"Hydra would create the classes these callbacks name ({names}) when a sweep starts, even under "
                "--plan; miles-run never instantiates a class named by a config.",
                "remove the hydra.callbacks section from the config file",
            )
        )
    for kind, base in (("launcher", "hydra.plugins.launcher.Launcher"), ("sweeper", "hydra.plugins.sweeper.Sweeper")):
        target = OmegaConf.select(hydra_node, f"{kind}._target_", default=None)
        if target is not None and target not in installed_plugins(base):
            problems.append(
                Problem(
                    f"hydra-{kind}-not-a-plugin",
                    [(f"hydra.{kind}._target_={target}", FROM_CONFIG)],
                    f"hydra.{kind}._target_ names a class that is not an installed Hydra {kind} plugin; Hydra would "
                    "create it before checking its type.",
                    f"pick an installed {kind}: " + ", ".join(sorted(installed_plugins(base))),
                )
            )
    for node in LOGGING_NODES:
        if _container(hydra_node.get(node)) != _container(shipped().get(node)):
            problems.append(
                Problem(
                    "hydra-logging-refused",
                    [(f"hydra.{node}", FROM_CONFIG)],
                    f"hydra.{node} configures Python logging, whose handlers are classes that Hydra creates (and files "
                    "it opens); a run logs to RUN_DIR/logs/driver.log and the console as shipped.",
                    f"remove hydra.{node} (and any hydra/{node} default) from the config file",
                )
            )
    return problems


def _container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=False) if node is not None else None


@cache
def installed_plugins(base: str) -> frozenset[str]:
    """The import paths of the Hydra plugins of one kind installed here (Hydra's own plugin scan)."""
    from hydra.core.plugins import Plugins
    from hydra.utils import get_class

    plugins = Plugins.instance().discover(get_class(base))
    return frozenset(f"{cls.__module__}.{cls.__name__}" for cls in plugins)
