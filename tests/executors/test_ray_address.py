"""executor.ray_address: the Ray executor joins a Ray cluster that is already up (here a head started on loopback
for the test, as plan node 0: it offers miles_node_0) instead of starting its own, runs the plan's servers on it,
and leaves it running after the run. A cluster that does not say which node is plan node 0 is refused at once.

The head uses the test process's Ray authentication mode. A local Ray started in the process earlier (ray.init()
without an address, as test_run_key.py's Ray test does) turns token authentication on (it sets RAY_AUTH_MODE and
re-reads its config), and the process's Ray core stays in token mode after that Ray's shutdown: a driver in token
mode that joins a head with auth off refuses the head's GCS calls ("Missing authorization header in request!" in its
log), and the GCS takes it for dead and destroys its first actor. A head in token mode reads the same token
(~/.ray/auth_token, which that local Ray wrote), so this file passes after those tests as well as before them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles_runner.config.compose import compose
from miles_runner.core.cluster_nodes import node_resource
from miles_runner.executors.ray import ClusterNodesError, RayExecutor
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan
from miles_runner.procs.ports import port_is_free
from miles_runner.procs.process import ManagedProcess

pytestmark = pytest.mark.slow

MARKER = "existing_cluster"  # a custom resource only the test's own head node has


@pytest.fixture(params=[True], ids=["node0"])
def ray_head(tmp_path, request) -> Iterator[tuple[str, ManagedProcess]]:
    """A Ray head node on 127.0.0.1 (its whole process group is stopped afterwards), offering miles_node_0 unless
    the test asks otherwise (indirect parametrisation); yields its address once it is up.

    Each of the head's ports is 0, so the kernel picks it as the component binds it. A port picked here would stay
    free for any process on the host until `ray start` binds it, seconds later: another test's server that took the
    GCS port in between left the GCS unable to start, while the port, held by that server, looked like the head's."""
    resources = {MARKER: 1, **({node_resource(0): 1000} if request.param else {})}
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0", "Ray must stay on loopback in tests"
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    argv = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--port=0",
        "--num-cpus=1",
        f"--resources={json.dumps(resources)}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        "--dashboard-agent-listen-port=0",  # the one agent port with a fixed default (52365); the others pick at bind
    ]
    # The driver's mode: off (a driver given an explicit address sends no token) unless the process is in token mode.
    env = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    head = ManagedProcess("ray-head", argv, env=env, log_path=tmp_path / "ray_head.log").start()
    address_file = Path(temp_dir) / "ray_current_cluster"  # the GCS address, written by `ray start` once the head is up
    try:
        deadline = time.monotonic() + 60
        while not (address := address_file.read_text().strip() if address_file.is_file() else ""):
            assert head.alive and time.monotonic() < deadline, head.log_tail()
            time.sleep(0.2)
        yield address, head
    finally:
        # `ray start --block` is slow to end after SIGTERM (its GCS shuts down gracefully): the test is over,
        # so what is left after 2 s is killed.
        head.stop(timeout_s=2)
        # The head's logs (raylet, workers) stay with the test's folder: why an actor died is only written there.
        if (logs := Path(temp_dir) / "session_latest" / "logs").is_dir():  # none where the head never started
            shutil.copytree(logs, tmp_path / "ray_logs", dirs_exist_ok=True, ignore_dangling_symlinks=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


def plan_on(address: str) -> Plan:
    """The tiny recipe, without session server, on the Ray cluster at `address`."""
    return compile_plan(
        compose(
            [
                "+recipe=tiny_lora_agentic",
                "session=off",
                "executor=ray",
                f"executor.ray_address={address}",
            ]
        )
    )


@pytest.mark.timeout(300)
def test_the_ray_executor_runs_the_plan_on_the_cluster_at_ray_address_and_leaves_it_up(tmp_path, ray_head):
    import ray

    address, head = ray_head
    plan = plan_on(address)
    with RayExecutor(plan, tmp_path, startup_timeout_s=180) as deployment:
        assert ray.cluster_resources().get(MARKER) == 1, "the executor is not on the cluster at ray_address"
        assert httpx.get(deployment.rollout_url + "/health", timeout=10).status_code == 200
        engine_port = deployment.plan.engines[0].launch.port
    assert not ray.is_initialized()  # the driver left the cluster...
    assert head.alive  # ...which it did not start, and does not stop
    assert port_is_free("127.0.0.1", engine_port), "the plan's engine outlived the run"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ray_head", [False], ids=["no-node-resource"], indirect=True)
def test_a_cluster_with_no_node_offering_miles_node_0_is_refused_before_anything_starts(tmp_path, ray_head):
    import ray

    address, _ = ray_head
    plan = plan_on(address)
    with pytest.raises(ClusterNodesError, match="node 0 \\(miles_node_0\\)"):
        RayExecutor(plan, tmp_path).start()
    assert not ray.is_initialized()
    assert not (tmp_path / "logs").exists(), "something was started"


@pytest.mark.timeout(120)
def test_stopping_after_the_cluster_went_does_not_wait_on_its_gcs(tmp_path, ray_head, caplog):
    """Slurm's SIGTERM takes the job's Ray with the run: removing a placement group then blocks for good, and the
    driver's whole teardown must fit in Slurm's KillWait. The stop sees that the GCS no longer answers and leaves
    the groups, which went with it, without spending the bound of the agents' stop on them."""
    import ray
    from ray.util.placement_group import placement_group

    address, head = ray_head
    plan = plan_on(address)
    executor = RayExecutor(plan, tmp_path)
    executor._init_ray()
    group = placement_group([{MARKER: 0.5}])
    ray.get(group.ready(), timeout=60)
    executor.groups = [group]
    head.stop(timeout_s=2)  # the whole cluster goes, as under Slurm's SIGTERM (and its SIGKILL after KillWait)
    with caplog.at_level(logging.WARNING, logger="miles_runner.executors.ray"):
        executor.stop()
    assert f"Ray's GCS at {address} is gone, and the run's placement groups with it" in caplog.text
    assert "did not answer within" not in caplog.text, "the stop waited out the agents' bound on the gone GCS"
    assert not ray.is_initialized()
