"""The Ray executor: the plan's servers run under a Ray actor, so Ray owns their placement and lifetime.

A `NodeAgent` actor runs the local executor's start-up (engines -> router -> session server, health-checked)
on its node and stops everything when asked or when Ray tears it down. Without `executor.ray_address` a
private Ray is started on loopback for the run and shut down after it. This release places every component on
the head node: the plan rule multi-node-ray-not-built refuses a multi-node plan (cross-node placement needs
per-node agents and routable addresses: issue 12).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_runner.core.errors import ComponentFailure
from miles_runner.executors.local import Deployment, Executor, LocalExecutor
from miles_runner.plan.model import Plan, plan_from_dict, plan_to_dict


class NodeAgentBody:
    """What the Ray actor does; a plain class so it reads (and tests) without Ray."""

    def __init__(self, plan_dict: dict[str, Any], run_dir: str, startup_timeout_s: float | None):
        self.executor = LocalExecutor(plan_from_dict(plan_dict), Path(run_dir), startup_timeout_s=startup_timeout_s)

    def start(self) -> dict[str, Any]:
        d = self.executor.start()
        return {"engine_urls": d.engine_urls, "rollout_url": d.rollout_url, "session_url": d.session_url,
                "pids": [p.pid for p in d.processes]}

    def stop(self) -> None:
        self.executor.stop()

    def restart_dead_engines(self) -> list[int]:
        return self.executor.restart_dead_engines()

    def dead_components(self) -> list[ComponentFailure]:
        return self.executor.dead_components()


class RayExecutor(Executor):
    def __init__(self, plan: Plan, run_dir: Path, *, startup_timeout_s: float | None = None):
        self.plan, self.run_dir, self.startup_timeout_s = plan, Path(run_dir), startup_timeout_s
        self.agent = None
        self.owns_ray = False
        self.pids: list[int] = []

    def start(self) -> Deployment:
        import ray

        if not ray.is_initialized():
            address = self.plan.executor.ray_address or None
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     **({} if address else {"num_cpus": max(self.plan.cluster.slots_per_node, 1)}))
            self.owns_ray = True
        agent_class = ray.remote(num_cpus=0)(NodeAgentBody)
        self.agent = agent_class.remote(plan_to_dict(self.plan), str(self.run_dir.resolve()), self.startup_timeout_s)
        try:
            info = ray.get(self.agent.start.remote())
        except BaseException:
            self.stop()
            raise
        self.pids = info["pids"]
        return Deployment(info["engine_urls"], info["rollout_url"], info["session_url"])

    def restart_dead_engines(self) -> list[int]:
        import ray

        return ray.get(self.agent.restart_dead_engines.remote())

    def dead_components(self) -> list[ComponentFailure]:
        import ray

        return ray.get(self.agent.dead_components.remote(), timeout=60) if self.agent is not None else []

    def stop(self) -> None:
        import ray

        if self.agent is not None:
            try:
                ray.get(self.agent.stop.remote(), timeout=60)
            finally:
                ray.kill(self.agent)
                self.agent = None
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False


def make_executor(plan: Plan, run_dir: Path) -> Executor:
    return RayExecutor(plan, run_dir) if plan.executor.kind == "ray" else LocalExecutor(plan, run_dir)
