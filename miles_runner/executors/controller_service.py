"""Where the multi-LoRA controller service runs (docs/system.md §4.3): a child process of the driver with the local
executor; with `executor=ray`, the same service under the named Ray actor `miles_multi_lora_controller` in
namespace `miles` (num_cpus=0, pinned to the head node), which owns the service process's lifetime.

Either way the service is the plan's controller launch line, run in the run folder (it reads plan.yaml), and
the driver talks to it over its HTTP API; `controller_service(plan, run_dir)` is a context manager that
starts it healthy and stops it, whatever ends the block.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any

from miles_runner.plan.model import CONTROLLER, Launch, Plan, plan_from_dict, plan_to_dict, plan_with_ports
from miles_runner.plan.record import write_ports
from miles_runner.procs.launch import check_ports, launch_process
from miles_runner.procs.ports import ANY_ADDRESS, free_port
from miles_runner.procs.process import ManagedProcess

CONTROLLER_ACTOR = "miles_multi_lora_controller"
NAMESPACE = "miles"


def controller_launch(plan: Plan) -> Launch:
    if plan.multi_lora is None:
        raise ValueError("this plan has no multi-LoRA controller (adapters=single)")
    return plan.multi_lora.launch


def choose_controller_port(plan: Plan, run_dir: Path) -> Plan:
    """The plan with the controller's port chosen, if it is chosen at start ("auto"), and recorded with the others
    (the service starts on the driver's node, or the Ray head node, which is the same)."""
    launch = controller_launch(plan)
    if not launch.port_name:
        return plan
    ports = {launch.port_name: free_port(ANY_ADDRESS)}
    write_ports(run_dir, ports, add=True)
    return plan_with_ports(plan, ports)


def controller_process(plan: Plan, run_dir: Path) -> ManagedProcess:
    """The controller service as a supervised child process (`with` starts it healthy), run in the run folder."""
    launch = controller_launch(plan)
    check_ports([("the multi-LoRA controller", launch)])
    return launch_process(
        CONTROLLER,
        launch,
        run_dir / "logs",
        startup_timeout_s=plan.executor.health_timeout_s,
        cwd=run_dir,
    )


class ControllerActorBody:
    """What the Ray actor does; a plain class so it reads (and tests) without Ray."""

    def __init__(self, plan_dict: dict[str, Any], run_dir: str) -> None:
        plan = plan_from_dict(plan_dict)
        launch = controller_launch(plan)
        self.host, self.port = launch.host, launch.port
        self.process = controller_process(plan, Path(run_dir))

    def start(self) -> int | None:
        """Start the service and wait until it is healthy; returns its pid."""
        self.process.start()
        self.process.wait_healthy()
        return self.process.pid

    def stop(self) -> None:
        self.process.stop()

    def http_host(self) -> str:
        return self.host

    def api_port(self) -> int:
        return self.port

    def node_id(self) -> str:
        """The Ray node the actor (and so the service) runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


class RayControllerService:
    """The controller under a named, detached-from-nothing Ray actor on the head node (the driver's node)."""

    def __init__(self, plan: Plan, run_dir: Path) -> None:
        self.plan, self.run_dir = plan, Path(run_dir)
        self.actor: Any = None

    def __enter__(self) -> RayControllerService:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from miles_runner.executors.ray import key_runtime_env

        head = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor_class = ray.remote(num_cpus=0)(ControllerActorBody)
        self.actor = actor_class.options(
            name=CONTROLLER_ACTOR, namespace=NAMESPACE, scheduling_strategy=head, runtime_env=key_runtime_env(self.plan)
        ).remote(plan_to_dict(self.plan), str(self.run_dir.resolve()))
        try:
            ray.get(self.actor.start.remote())
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()

    def _stop(self) -> None:
        import ray

        if self.actor is None:
            return
        try:
            ray.get(self.actor.stop.remote(), timeout=60)
        finally:
            ray.kill(self.actor)
            self.actor = None


def controller_service(plan: Plan, run_dir: Path) -> AbstractContextManager[Any]:
    """The controller service for the plan's executor (call it once the executor has started: Ray is up)."""
    if plan.executor.kind == "ray":
        return RayControllerService(plan, run_dir)
    return controller_process(plan, run_dir)
