"""With executor=ray the multi-LoRA controller runs under the named Ray actor `miles_multi_lora_controller`
(namespace `miles`, on the head node), a real local Ray on loopback, and a whole multi-LoRA run trains under it."""

from __future__ import annotations

import os

import httpx
import pytest

from miles_runner.executors.controller_service import CONTROLLER_ACTOR, NAMESPACE, RayControllerService
from miles_runner.plan.record import read_plan
from miles_runner.procs.ports import port_is_free

from .runs import events, metrics, plan_run, start_driver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

RUNS = "adapters.runs=[{name: count, task: count}, {name: arith, task: arith}]"


@pytest.fixture(scope="module")
def local_ray():
    import ray

    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0", "Ray must stay on loopback in tests"
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_the_controller_serves_under_its_named_actor_on_the_head_node_and_stops_with_it(local_ray, tmp_path):
    run_dir = plan_run(tmp_path / "outputs", RUNS, "executor=ray")
    plan = read_plan(run_dir / "plan.yaml")
    url = plan.multi_lora.launch.url
    with RayControllerService(plan, run_dir):
        actor = local_ray.get_actor(CONTROLLER_ACTOR, namespace=NAMESPACE)
        assert local_ray.get(actor.node_id.remote()) == local_ray.get_runtime_context().get_node_id()
        assert local_ray.get([actor.http_host.remote(), actor.api_port.remote()]) == [
            plan.multi_lora.launch.host,
            plan.multi_lora.launch.port,
        ]
        assert httpx.get(f"{url}/health", timeout=10, trust_env=False).json() == {"status": "healthy"}
        names = [a["name"] for a in httpx.get(f"{url}/adapter_runs", timeout=10, trust_env=False).json()["adapters"]]
        assert sorted(names) == ["arith", "count"]  # the plan's adapters, registered by the service at start
    assert port_is_free(plan.multi_lora.launch.host, plan.multi_lora.launch.port)
    with pytest.raises(ValueError):
        local_ray.get_actor(CONTROLLER_ACTOR, namespace=NAMESPACE)


def test_a_multi_lora_run_trains_with_the_ray_executor(tmp_path):
    run_dir = plan_run(
        tmp_path / "outputs",
        RUNS,
        "executor=ray",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "algorithm.num_steps=2",
    )
    proc = start_driver(run_dir)
    out, _ = proc.communicate(timeout=360)
    assert proc.returncode == 0, out[-4000:]
    records = metrics(run_dir)
    final = {name: max(r[f"{name}/step"] for r in records if f"{name}/step" in r) for name in ("count", "arith")}
    assert final == {"count": 2, "arith": 2}
    assert events(run_dir, "pushed_all")  # the engines (under the Ray node agent) received the adapters
