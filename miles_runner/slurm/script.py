"""The sbatch script of one job, rendered from its plan (nodes, GPUs) and the launcher settings (the rest).

The job script starts one Ray per node with `srun` (the head on the first node, workers on the others, node K
offering the custom resource miles_node_K), waits until every node has joined (or fails naming the missing
ones), runs the job's recorded plan (resuming from its last checkpoint after a requeue) and stops its own Ray.
Ports and the Ray temp folder are per job, so two jobs on one node do not collide; `ray stop` is not used,
because it would stop every Ray of the node, another job's included.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from miles_runner.core.cluster_nodes import NODE_RESOURCE_PREFIX, NODE_RESOURCE_UNITS, node_resource
from miles_runner.plan.model import Plan
from miles_runner.procs.warm import WARM_START_ENV
from miles_runner.slurm.settings import SlurmSettings

JOB_SCRIPT = "job.sbatch"  # in the job folder
JOB_LOG = "slurm.out"  # in the job folder: every attempt appends to it
LOOPBACK = "127.0.0.1"


def job_name(plan: Plan, settings: SlurmSettings) -> str:
    return settings.job_name or f"miles-{plan.name}"


def header_options(plan: Plan, settings: SlurmSettings) -> list[str]:
    """The #SBATCH options every job of a sweep shares (one job array): the plan's shape, then the settings."""
    cluster = plan.cluster
    options = [f"--nodes={cluster.nodes}", "--ntasks-per-node=1"]
    if cluster.gpus_per_node:
        options.append(f"--gpus-per-node={cluster.gpus_per_node}")
    for flag, value in (
        ("--cpus-per-task", settings.cpus_per_task or ""),
        ("--mem", settings.mem),
        ("--time", settings.time),
        ("--partition", settings.partition),
        ("--account", settings.account),
        ("--qos", settings.qos),
    ):
        if value != "":
            options.append(f"{flag}={value}")
    # A requeued job runs the same script in the same folder and appends to the same log.
    options += ["--requeue" if settings.requeue else "--no-requeue", "--open-mode=append"]
    return options + [line.strip().removeprefix("#SBATCH").strip() for line in settings.extra_sbatch]


def render_job_script(plan: Plan, settings: SlurmSettings, job_dir: str | Path, python: str) -> str:
    """A complete sbatch script for this one job (what `--plan` prints; a sweep's array runs its body)."""
    head = [
        f"--job-name={job_name(plan, settings)}",
        *header_options(plan, settings),
        f"--output={Path(job_dir) / 'sbatch-%j.out'}",
    ]
    return "#!/bin/bash\n" + "".join(f"#SBATCH {o}\n" for o in head) + job_body(plan, settings, job_dir, python)


def render_array_script(options: list[str], name: str, sweep_dir: Path, job_dirs: list[Path]) -> str:
    """The sweep as one job array: task i runs the job script of job folder i."""
    head = [
        f"--job-name={name}",
        *options,
        f"--array=0-{len(job_dirs) - 1}",
        f"--output={sweep_dir / 'sbatch-%A_%a.out'}",
    ]
    cases = "".join(f"  {i}) JOB_DIR={shlex.quote(str(d))} ;;\n" for i, d in enumerate(job_dirs))
    return (
        "#!/bin/bash\n"
        + "".join(f"#SBATCH {o}\n" for o in head)
        + f'case "$SLURM_ARRAY_TASK_ID" in\n{cases}  *) echo "miles: no job for array task '
        + '$SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;\nesac\n'
        + f'exec bash "$JOB_DIR/{JOB_SCRIPT}"\n'
    )


def job_body(plan: Plan, settings: SlurmSettings, job_dir: str | Path, python: str) -> str:
    cluster = plan.cluster
    srun = "srun --overlap -N1 -n1 " + "".join(f"{shlex.quote(a)} " for a in settings.srun_args)
    node_args = f"--num-cpus={max(cluster.devices_per_node, 1)} --num-gpus={cluster.gpus_per_node}"
    head_ip = (
        LOOPBACK
        if cluster.nodes == 1  # one node: every address stays on loopback
        else f'$({srun}-w "$HEAD" hostname -I | cut -d" " -f1)'
    )
    setup = "".join(f"{line}\n" for line in settings.setup)
    workers = worker_start(cluster.nodes, srun, node_args) if cluster.nodes > 1 else ""
    return f"""set -uo pipefail
JOB_DIR={shlex.quote(str(job_dir))}
PY={shlex.quote(python)}
mkdir -p "$JOB_DIR/logs"
exec >>"$JOB_DIR/{JOB_LOG}" 2>&1
echo "=== miles: attempt $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) of job ${{SLURM_JOB_ID}} on ${{SLURM_JOB_NODELIST}} \
at $(date -u +%FT%TZ) ==="
{setup}RAY="$PY -m ray.scripts.scripts"
NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
HEAD=${{NODES[0]}}
RAY_TMP=/tmp/miles-ray-$SLURM_JOB_ID
# Ray's ports, picked on the node at each attempt: never one the plan's servers bind once Ray is up.
read -r RAY_PORT AGENT_PORT <<<"$("$PY" -m miles_runner.slurm.free_ports 2 --plan "$JOB_DIR/plan.yaml")"
HEAD_IP={head_ip}
export RAY_ADDRESS=$HEAD_IP:$RAY_PORT
# Ray's token authentication with a token of this job's own: its Ray processes (srun passes the environment on)
# and its driver have it, nothing else on the nodes does.
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(32))')
# On SIGTERM a node's Ray stops at once (by default it drains for 30 s, Slurm's whole KillWait): nothing here
# serves traffic that a drain would protect.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
# The job's processes start inside the job, never forked by a warm start server of the submitter's (procs/warm.py).
unset {WARM_START_ENV}
RAY_PIDS=()
DRIVER=""
stop_ray() {{
  kill -TERM "${{RAY_PIDS[@]}}" 2>/dev/null; wait "${{RAY_PIDS[@]}}" 2>/dev/null; rm -rf "$RAY_TMP"
}}
on_term() {{
  echo "miles: SIGTERM (requeue, preemption or cancel): stopping the run, then this job's Ray"
  if [ -n "$DRIVER" ]; then kill -TERM "$DRIVER" 2>/dev/null; wait "$DRIVER"; fi
  stop_ray; exit 143
}}
trap on_term TERM
{srun}-w "$HEAD" $RAY start --head --block --node-ip-address="$HEAD_IP" --port="$RAY_PORT" \\
  --dashboard-agent-listen-port="$AGENT_PORT" --include-dashboard=false \\
  --temp-dir="$RAY_TMP" {node_args} --resources='{json.dumps({node_resource(0): NODE_RESOURCE_UNITS})}' \\
  >>"$JOB_DIR/logs/ray-node-0.log" 2>&1 &
RAY_PIDS+=($!)
{workers}"$PY" -m miles_runner.slurm.wait_nodes --nodes {cluster.nodes} --timeout {settings.nodes_timeout_s} \\
  --hosts "${{NODES[*]}}" --job-dir "$JOB_DIR" &
DRIVER=$!
wait "$DRIVER"; RC=$?
if [ "$RC" = 0 ]; then
  "$PY" -m miles_runner.cli.recorded_run "$JOB_DIR" &
  DRIVER=$!
  wait "$DRIVER"; RC=$?
fi
DRIVER=""
stop_ray
exit "$RC"
"""


def worker_start(nodes: int, srun: str, node_args: str) -> str:
    """Ray on nodes 1..N-1, each offering its own miles_node_K and picking its agent port on that node."""
    resources = '{\\"' + NODE_RESOURCE_PREFIX + '$K\\": ' + str(NODE_RESOURCE_UNITS) + "}"
    return f"""export PY RAY RAY_ADDRESS JOB_DIR
for ((K = 1; K < {nodes}; K++)); do
  RES="{resources}" {srun}-w "${{NODES[$K]:-missing}}" bash -c \\
    '$RAY start --block --address="$RAY_ADDRESS" {node_args} --resources="$RES" \\
    --dashboard-agent-listen-port="$($PY -m miles_runner.slurm.free_ports 1 --plan "$JOB_DIR/plan.yaml")"' \\
    >>"$JOB_DIR/logs/ray-node-$K.log" 2>&1 &
  RAY_PIDS+=($!)
done
"""
