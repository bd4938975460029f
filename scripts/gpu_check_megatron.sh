#!/usr/bin/env bash
# GPU check of the Megatron trainer: the tiny recipe (tiny_lora_agentic: tiny-moe, attention LoRA, GRPO on
# count_retry) with trainer=megatron against real SGLang on one GPU, first lora_mode=raw, then lora_mode=bridge;
# then the CPU twin of qwen3_30b_a3b_r3_session (`twin`: Bridge LoRA, router, session v1, in_place, R3, offload
# both ways) and of glm52_lora_agentic (`glm`: GLM-5's MLA + DSA shape, Bridge LoRA on its MLA linears, session v1
# with GLM-4.7's TITO, retract, R3, offload to disk, the CPU-offloaded optimizer) on that GPU with real SGLang, and
# (`optimizer`) the test that reads Megatron's HybridDeviceOptimizer settings back, and (`glm-fp8`) the glm twin
# with glm52's FP8 rollout (SGLang's --quantization fp8), which the embedded engine does not run. The multi_lora_math twin needs
# the sglang-miles fork (broadcast adapter sync), which is not on PyPI: it is not run here. Prints each run's
# reward per step and the trainer/engine logprob
# mismatch figures from its metrics.jsonl (and for the twin what offload costs and frees):
#   train/logprob_abs_diff  mean |trainer - rollout| logprob over the trained tokens of the step
#   verify/logprob_gap      the push probe's |trainer - engine| gap right after each adapter push (the run fails
#                           when it passes sync.max_logprob_gap: 0.05 for SGLang unless MAX_LOGPROB_GAP says);
#                           under offload every push follows a resume of the engine's memory
#   offload/seconds         (twin) the seconds the step's release/resume and trainer offload calls took
#   GPU MB used             (twin) nvidia-smi's used memory sampled every 0.2 s through the run: the lowest (engine
#                           released, trainer offloaded) and the highest, i.e. what offload gives back and takes
#
#   scripts/gpu_check_megatron.sh [--plan-only] [--skip-install] [--only MODE] [--summarize DIR]
#
#   --plan-only      compile the plans it would run (`miles-run ... --plan`) and stop; needs no GPU (MILES_RUN
#                    names the miles-run to use, default .venv/bin/miles-run)
#   --skip-install   use the GPU venv as it is
#   --only MODE      run one of raw, bridge, twin, glm, glm-fp8, optimizer
#   --summarize DIR  only print and check the figures of the run under DIR ($STEPS records; $PYTHON, or python3)
# Environment: GPU_VENV (.venv-gpu), GPU_PY (python3.12: Megatron-Bridge needs 3.12), STEPS (3),
# RUN_TIMEOUT_S (240 per run), MAX_LOGPROB_GAP (the plan's default), WORK_DIR (a fresh /tmp folder).
# Exit: 0 every run passed, 1 a run or its figures failed, 2 this machine cannot run it (no GPU, no python3.12).
#
# Install (where pip reaches PyPI): one Python 3.12 venv holds everything, since the engines run with the run's own
# interpreter. `pip install -e '.[gpu]'` cannot resolve there: sglang 0.5.23 pins torch==2.14.1 and
# transformers==5.19.0 while the project pins its CPU torch==2.13.0 and megatron-bridge 0.6.2 wants
# transformers<=5.12.1. So: SGLang with its own CUDA torch first, then the project's other dependencies and the
# project (no deps) under a constraint that keeps SGLang's torch and transformers, then Transformer Engine (Bridge's
# LoRA imports it on CUDA) and megatron-bridge without its dependencies, as `make bridge-env` installs it.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

PLAN_ONLY=0
SKIP_INSTALL=0
SUMMARIZE=""
MODES=(raw bridge twin glm glm-fp8 optimizer)
while (($#)); do
    case "$1" in
        --plan-only) PLAN_ONLY=1 ;;
        --skip-install) SKIP_INSTALL=1 ;;
        --only)
            [[ "${2:-}" =~ ^(raw|bridge|twin|glm|glm-fp8|optimizer)$ ]] ||
                { echo "--only takes raw, bridge, twin, glm, glm-fp8 or optimizer" >&2; exit 2; }
            MODES=("$2")
            shift
            ;;
        --summarize)
            [[ -n "${2:-}" ]] || { echo "--summarize takes a run folder" >&2; exit 2; }
            SUMMARIZE="$2"
            shift
            ;;
        -h | --help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

GPU_VENV="${GPU_VENV:-.venv-gpu}"
GPU_PY="${GPU_PY:-python3.12}"
STEPS="${STEPS:-3}"
RUN_TIMEOUT_S="${RUN_TIMEOUT_S:-240}"
export MILES_CACHE_DIR="${MILES_CACHE_DIR:-$REPO_ROOT/.cache}"
export HF_HUB_OFFLINE=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

# What a tiny model + SGLang + Megatron plan needs on one GPU: the engine takes a small share of the memory; no CUDA
# graphs (a faster start); the triton attention backend takes the tiny model's head size (16). The raw and bridge
# runs keep the trainer and the engine resident side by side; the twin offloads both ways, as its GPU recipe does,
# with its one trainer rank and one engine on the one GPU, in this environment's Python (trainer.python empty).
run_overrides() {
    local mode="$1" overrides
    if [[ "$mode" == twin || "$mode" == glm* ]]; then
        local recipe=tiny_qwen3_30b_a3b_r3_session
        [[ "$mode" == glm* ]] && recipe=tiny_glm52_lora_agentic
        overrides=("+recipe=$recipe" engine=sglang cluster=gpu_1x "trainer.python=''"
            topology.actor_num_gpus_per_node=1 trainer.parallel.ep=1)
        [[ "$mode" == glm-fp8 ]] && overrides+=(engine.fp8_rollout=true)
    else
        overrides=(+recipe=tiny_lora_agentic trainer=megatron "lora_mode=$mode" engine=sglang cluster=gpu_1x
            topology.offload_train=false topology.offload_rollout=false)
    fi
    overrides+=(
        engine.enable_cuda_graph=false engine.mem_fraction_static=0.3 'engine.extra_args=[--attention-backend,triton]'
        "algorithm.num_steps=$STEPS" "run.output_root=$WORK_DIR/$mode"
    )
    if [[ -n "${MAX_LOGPROB_GAP:-}" ]]; then
        overrides+=("weight_sync.max_logprob_gap=$MAX_LOGPROB_GAP")
    fi
    printf '%s\n' "${overrides[@]}"
}

plan_all() {
    local miles_run="$1" mode failed=0
    for mode in "${MODES[@]}"; do
        [[ "$mode" == optimizer ]] && continue  # a test, no plan
        mapfile -t overrides < <(run_overrides "$mode")
        echo "== plan $mode"
        if ! "$miles_run" "${overrides[@]}" --plan; then
            echo "FAIL: the $mode plan does not compile" >&2
            failed=1
        fi
    done
    return "$failed"
}

pin() {  # pyproject's exact pin of a package (the Makefile reads them the same way)
    sed -n "s/.*\"$1==\([^\";]*\).*/\1/p" pyproject.toml | head -1
}

install_gpu_venv() {
    local py="$GPU_VENV/bin/python" constraints="$WORK_DIR/constraints.txt" requirements="$WORK_DIR/requirements.txt"
    test -x "$py" || "$GPU_PY" -m venv "$GPU_VENV"
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q "sglang==$(pin sglang)"
    "$py" -m pip freeze | grep -iE '^(torch|transformers|tokenizers)==' >"$constraints"
    # The project's dependencies except torch (SGLang's CUDA build stays), markers evaluated by pip.
    "$py" -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))' >"$requirements"
    "$py" -m pip install -q -r "$requirements" -c "$constraints"
    "$py" -m pip install -q --no-deps -e .
    # Transformer Engine builds its torch extension against the installed torch (no build isolation).
    "$py" -m pip install -q --no-build-isolation -c "$constraints" 'transformer-engine[pytorch]'
    "$py" -m pip install -q -c "$constraints" einops six pytest pytest-asyncio
    "$py" -m pip install -q --no-deps "megatron-bridge==$(pin megatron-bridge)"
}

gpu_ready() {  # why this machine cannot run the check (its last line of error), or nothing
    local out
    if ! out="$("$GPU_VENV/bin/python" -c 'import sys, torch, sglang, megatron.core
sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA device")' 2>&1)"; then
        echo "${out##*$'\n'}"
    fi
}

summarize() {  # reward per step and the mismatch figures of one run; non-zero when they are missing or wrong
    "${PYTHON:-$GPU_VENV/bin/python}" - "$1" "$STEPS" <<'EOF'
import json, math, pathlib, sys

folder, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
found = sorted(folder.rglob("metrics.jsonl"))
if not found:
    sys.exit(f"no metrics.jsonl under {folder}")
records = [json.loads(line) for line in found[-1].read_text().splitlines() if line.strip()]
keys = ("reward/mean", "train/logprob_abs_diff", "verify/logprob_gap")
if "offload/seconds" in records[0]:
    keys += ("offload/seconds",)


def cell(value):
    return f"{value:>22.4f}" if isinstance(value, (int, float)) else f"{value!s:>22}"


print(f"{'step':>4}  " + "  ".join(f"{k:>22}" for k in keys))
for r in records:
    print(f"{r.get('step', '?'):>4}  " + "  ".join(cell(r.get(k)) for k in keys))
problems = [] if len(records) == steps else [f"{len(records)} step records, expected {steps}"]
for key in keys:
    values = [r.get(key) for r in records]
    if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in values):
        problems.append(f"{key} missing or not finite in some step")
samples = folder / "gpu_memory_mb.txt"
if samples.exists() and (used := [int(x) for x in samples.read_text().split()]):
    print(f"GPU MB used through the run: lowest {min(used)}, highest {max(used)} ({len(used)} samples)")
sys.exit("; ".join(problems) or None)
EOF
}

run_optimizer_test() {  # Megatron's HybridDeviceOptimizer built with miles' settings, read back, one step
    echo "== run optimizer (tests/trainer/megatron/test_cpu_offload_optimizer.py)"
    "$GPU_VENV/bin/python" -m pytest -q -rs tests/trainer/megatron/test_cpu_offload_optimizer.py \
        -p no:cacheprovider || { echo "FAIL: optimizer" >&2; return 1; }
}

run_mode() {
    [[ "$1" == optimizer ]] && { run_optimizer_test; return; }
    local mode="$1" log="$WORK_DIR/$1.log" started=$SECONDS
    mapfile -t overrides < <(run_overrides "$mode")
    echo "== run $mode ($STEPS steps, at most ${RUN_TIMEOUT_S}s; log $log)"
    mkdir -p "$WORK_DIR/$mode"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$WORK_DIR/$mode/gpu_memory_mb.txt" &
    local sampler=$! code=0
    timeout --kill-after=30 "$RUN_TIMEOUT_S" "$GPU_VENV/bin/miles-run" "${overrides[@]}" >"$log" 2>&1 || code=$?
    kill "$sampler" 2>/dev/null || true
    if ((code)); then
        echo "FAIL: $mode run failed or timed out after $((SECONDS - started))s; its log ends:" >&2
        tail -n 40 "$log" >&2
        return 1
    fi
    echo "$mode finished in $((SECONDS - started))s"
    summarize "$WORK_DIR/$mode" || { echo "FAIL: $mode figures" >&2; return 1; }
}

if [[ -n "$SUMMARIZE" ]]; then
    PYTHON="${PYTHON:-python3}" summarize "$SUMMARIZE"
    exit
fi
WORK_DIR="${WORK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_megatron.XXXXXX")}"
mkdir -p "$WORK_DIR"
if ((PLAN_ONLY)); then
    plan_all "${MILES_RUN:-.venv/bin/miles-run}"
    exit
fi
command -v nvidia-smi >/dev/null || { echo "SKIP: no nvidia-smi: this is not a GPU machine" >&2; exit 2; }
if ((!SKIP_INSTALL)); then
    command -v "$GPU_PY" >/dev/null || { echo "SKIP: $GPU_PY not found (GPU_PY names another)" >&2; exit 2; }
    install_gpu_venv
fi
reason="$(gpu_ready)"
[[ -z "$reason" ]] || { echo "SKIP: $reason" >&2; exit 2; }
# The tiny model and its format pre-training are built once, outside the runs' time limits.
"$GPU_VENV/bin/python" -c 'from miles_runner.models.format_pretrain import ensure_format_pretrained as e
e("tiny-moe"); e("tiny-glm5")'
plan_all "$GPU_VENV/bin/miles-run"
failed=0
for mode in "${MODES[@]}"; do
    run_mode "$mode" || failed=1
done
echo "gpu_check_megatron: $([[ $failed == 0 ]] && echo PASSED || echo FAILED) (runs under $WORK_DIR)"
exit "$failed"
