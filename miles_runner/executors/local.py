"""The local executor: starts the plan's servers on this machine, in order, health-checked, and stops them all.

Engines (started together, then each waited for) -> router -> session server. The trainer runs in the
driver's own process. Whatever happens (success, an exception, Ctrl-C), every process started is stopped,
newest first; ports are checked before anything starts, so a busy port fails fast with its name.

An engine that dies mid-run is started again on the same port by `restart_dead_engines`, at most
`executor.engine_restarts` times each (and registered with the router again); it comes back without adapters,
which the driver notices from its weight version and pushes again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from miles_runner.core.errors import ComponentFailure
from miles_runner.engine.router import ensure_worker, wait_for_workers
from miles_runner.models.format_pretrain import ensure_format_pretrained
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.plan.derive import TINY_MODEL_SEED, parse_tiny_model
from miles_runner.plan.model import EnginePlan, Launch, Plan
from miles_runner.plan.model_shape import checkpoint_config, describe_mismatches, shape_mismatches
from miles_runner.procs.launch import check_ports, launch_process
from miles_runner.procs.ports import port_is_free
from miles_runner.procs.process import ManagedProcess, ProcessGroup

logger = logging.getLogger(__name__)


class EngineLostError(ComponentFailure):
    """An engine died and may not be restarted (`executor.engine_restarts` is used up)."""


@dataclass
class Deployment:
    """What the driver talks to once everything is up."""

    engine_urls: list[str]
    rollout_url: str  # the router, else the only engine
    session_url: str | None
    processes: list[ManagedProcess] = field(default_factory=list)


class Executor:
    """Start the plan's servers on enter, stop every one of them on exit (whatever ended the block)."""

    def start(self) -> Deployment:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def restart_dead_engines(self) -> list[int]:
        """Start again each engine that died; returns their indices. Raises EngineLostError past the limit."""
        raise NotImplementedError

    def dead_components(self) -> list[ComponentFailure]:
        """The started components that have exited, each with its exit code and log tail."""
        raise NotImplementedError

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # A run that failed because a server died usually fails somewhere else first (a refused connection in
        # the rollout): name the dead component instead, with its log, before stopping the others.
        dead = self.dead_components() if isinstance(exc, Exception) and not isinstance(exc, ComponentFailure) else []
        self.stop()
        if dead:
            raise dead[0] from exc


class LocalExecutor(Executor):
    def __init__(self, plan: Plan, run_dir: Path, *, startup_timeout_s: float | None = None):
        self.plan = plan
        self.run_dir = Path(run_dir)
        self.timeout_override = startup_timeout_s  # else each component's own timeout, from the plan
        self.startup_timeout_s = startup_timeout_s or plan.executor.health_timeout_s
        self.group = ProcessGroup()
        self.engines: list[ManagedProcess] = []  # by engine index, the current process of each
        self.restarts = [0] * len(plan.engines)

    def launches(self) -> list[tuple[str, Launch]]:
        named = [(f"engine{e.index}", e.launch) for e in self.plan.engines]
        if self.plan.router:
            named.append(("router", self.plan.router.launch))
        if self.plan.session:
            named.append(("session", self.plan.session.launch))
        return named

    def check_ports(self) -> None:
        check_ports(self.launches())

    def prepare_model(self) -> None:
        """Build the tiny model the plan names, if that is what it names and it is not cached yet: in the cache
        folder the plan was compiled with (a resumed run may have another MILES_CACHE_DIR now)."""
        if tiny := parse_tiny_model(self.plan.model.path):
            name, pretrained = tiny
            cache = Path(self.plan.model_path).parent
            if pretrained:
                built = ensure_format_pretrained(name, TINY_MODEL_SEED, cache)
            else:
                built = ensure_tiny_model(name, cache, TINY_MODEL_SEED)
            if str(built) != self.plan.model_path:
                raise RuntimeError(f"tiny model built at {built}, but the plan expects {self.plan.model_path}")
        self.check_model_shape()

    def check_model_shape(self) -> None:
        """The checkpoint on disk is the model the plan describes (the plan could check it only if it was there)."""
        config = checkpoint_config(self.plan.model_path, None)
        if config and (found := shape_mismatches(self.plan.model, config)):
            raise RuntimeError(f"{self.plan.model_path} is not the model the plan describes: "
                               f"{describe_mismatches(found)}")

    def process(self, name: str, launch: Launch, startup_timeout_s: float | None = None) -> ManagedProcess:
        timeout = startup_timeout_s or self.startup_timeout_s
        return launch_process(name, launch, self.run_dir / "logs", startup_timeout_s=timeout)

    def engine_process(self, engine: EnginePlan) -> ManagedProcess:
        """An engine may take engine.startup_timeout_s to become healthy (it loads the model), not the
        executor.health_timeout_s of the other components."""
        return self.process(f"engine{engine.index}", engine.launch, self.timeout_override or engine.startup_timeout_s)

    def start(self) -> Deployment:
        self.check_ports()
        self.prepare_model()
        engines = [self.engine_process(engine) for engine in self.plan.engines]
        try:
            for engine in engines:  # start together: their model loads overlap
                engine.start()
            for engine in engines:
                engine.wait_healthy()
                self.group.adopt(engine)
            for name, launch in self.launches():
                if not name.startswith("engine"):
                    self.group.start(process := self.process(name, launch))
                if name == "router":  # it answers /health at once, but drops engines it could not reach
                    wait_for_workers(process, launch.url, [e.launch.url for e in self.plan.engines],
                                     self.startup_timeout_s)
        except BaseException:
            for engine in engines:
                engine.stop()
            self.group.stop()
            raise
        self.engines = engines
        plan = self.plan
        return Deployment(
            engine_urls=[e.launch.url for e in plan.engines],
            rollout_url=plan.rollout_url,
            session_url=plan.session.launch.url if plan.session else None,
            processes=list(self.group.processes),
        )

    def stop(self) -> None:
        self.group.stop()

    def dead_components(self) -> list[ComponentFailure]:
        return [failure for process in self.group.processes if (failure := process.died())]

    def restart_dead_engines(self) -> list[int]:
        restarted = [index for index, engine in enumerate(self.engines) if not engine.alive]
        for index in restarted:
            self._restart_engine(index)
        return restarted

    def _restart_engine(self, index: int) -> None:
        dead, engine = self.engines[index], self.plan.engines[index]
        code = dead.returncode
        limit = self.plan.executor.engine_restarts
        if self.restarts[index] >= limit:
            raise EngineLostError(
                f"engine{index}",
                f"({engine.launch.url}) exited with code {code} and executor.engine_restarts={limit} restart(s) "
                "are used up. Raise executor.engine_restarts to let the run go on.",
                log_path=str(dead.log_path), log_tail=dead.log_tail(),
            )
        self.restarts[index] += 1
        logger.warning("engine%d exited with code %s; restart %d of %d", index, code, self.restarts[index], limit)
        dead.stop()  # reaps it, and whatever of its process group is left
        if not port_is_free(engine.launch.host, engine.launch.port):
            raise EngineLostError(f"engine{index}", f"died, but its port {engine.launch.port} is still held",
                                  log_path=str(dead.log_path), log_tail=dead.log_tail())
        self.engines[index] = self.group.replace(dead, self.engine_process(engine))
        if self.plan.router:
            ensure_worker(self.plan.router.launch.url, engine.launch.url, self.startup_timeout_s)
