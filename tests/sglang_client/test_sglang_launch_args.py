"""Every flag a plan renders for a real SGLang engine is one that the pinned `sglang.launch_server` defines, and
each engine.* GPU setting reaches that command line (the embedded engine refuses them: see the plan rules).

GPU plans are compiled as designs: this release refuses some of them for what it has not built (the FSDP trainer
on GPUs: fsdp-trainer-on-gpus-not-built; the Megatron trainer's offload, multi-LoRA, PP/CP/ETP and LoRA layouts:
megatron-*-not-built), and a design's engine command lines are the ones such a plan starts once they are built."""

import pytest

from miles_runner.config.compose import RECIPES_DIR, compose
from miles_runner.plan.compile import compile_design
from miles_testkit.contract.sglang_args import launch_flags
from miles_testkit.contract.sglang_spec import pinned_wheel

pytestmark = pytest.mark.integration

GPU = ["cluster=gpu_1x", "engine=sglang"]
GPU_SETTINGS = [
    *GPU,
    "engine.mem_fraction_static=0.7",
    "engine.dp_attention=true",
    "engine.enable_cuda_graph=false",
    "engine.fp8_rollout=true",
    "engine.lora_backend=csgmv",
    "engine.extra_args=[--max-running-requests,16]",
    "adapters.base_cpu_backup=true",
    "rollout.routing_replay=true",
    "engine.ep_size=1",
]
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


@pytest.fixture(scope="module")
def sglang_flags() -> frozenset[str]:
    return launch_flags(pinned_wheel())


def flags_of(argv: list[str]) -> list[str]:
    return [arg for arg in argv if arg.startswith("--")]


def test_the_reader_finds_sglangs_flags_and_nothing_else(sglang_flags):
    assert {"--model-path", "--tp-size", "--enable-lora", "--lora-paths", "--context-length"} <= sglang_flags
    assert "--not-a-flag" not in sglang_flags and "--engine-build" not in sglang_flags


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_flag_of_a_recipes_sglang_engines_exists_in_the_pinned_release(recipe, sglang_flags):
    plan = compile_design(compose([f"+recipe={recipe}"]))
    launches = [launch for e in plan.engines for launch in (e.launch, *(r.launch for r in e.node_ranks))]
    for launch in launches:
        if "sglang.launch_server" in launch.argv:
            assert set(flags_of(launch.argv)) <= sglang_flags, launch.argv


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def but_place(argv: list[str]) -> list[str]:
    """The command without what differs between an engine's node ranks: their own address, port and rank."""
    placed = {argv.index(name) + 1 for name in ("--host", "--port", "--node-rank")}
    return [arg for i, arg in enumerate(argv) if i not in placed]


def test_an_engine_wider_than_a_node_runs_sglangs_command_once_per_node_with_its_node_rank(sglang_flags):
    # glm52: 4 nodes x 8 GPUs, engines of TP 16: engine 0 on nodes 0-1, engine 1 on nodes 2-3; fixed ports, numbered.
    plan = compile_design(compose(["+recipe=glm52_lora_agentic", "engine.base_port=30010"]))
    assert [(e.nodes, [r.node for r in e.node_ranks]) for e in plan.engines] == [([0, 1], [1]), ([2, 3], [3])]
    for e in plan.engines:
        launches = [e.launch, *(r.launch for r in e.node_ranks)]
        assert [launch.node for launch in launches] == e.nodes  # rank R on the R-th node the engine spans
        assert {flag(launch.argv, "--dist-init-addr") for launch in launches} == {
            f"{{node{e.nodes[0]}}}:{30200 + 10 * e.index}"
        }
        for rank, launch in enumerate(launches):
            assert set(flags_of(launch.argv)) <= sglang_flags
            assert (flag(launch.argv, "--nnodes"), flag(launch.argv, "--node-rank")) == ("2", str(rank))
            assert flag(launch.argv, "--host") == launch.host == f"{{node{e.nodes[rank]}}}"
            assert flag(launch.argv, "--port") == str(launch.port)
            assert launch.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
            # SGLang checks tp_size % nnodes; every rank runs the same command but for its place
            assert flag(launch.argv, "--tp-size") == "16"
            assert but_place(launch.argv) == but_place(e.launch.argv)
    ports = [launch.port for e in plan.engines for launch in (e.launch, *(r.launch for r in e.node_ranks))]
    assert sorted(ports) == [30010, 30011, 30012, 30013]  # distinct even where nodes share an address
    # Engines within a node are one launch with no --nnodes.
    single = compile_design(compose(["+recipe=qwen3_30b_a3b_r3_session"]))
    assert all(not e.node_ranks and "--nnodes" not in e.launch.argv for e in single.engines)


def test_each_gpu_engine_setting_reaches_the_sglang_command_line(sglang_flags):
    argv = compile_design(compose(GPU_SETTINGS)).engines[0].launch.argv
    assert set(flags_of(argv)) <= sglang_flags, argv
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.7"
    assert argv[argv.index("--dp-size") + 1] == argv[argv.index("--tp-size") + 1]
    assert argv[argv.index("--quantization") + 1] == "fp8"
    assert argv[argv.index("--lora-backend") + 1] == "csgmv"
    assert argv[argv.index("--max-running-requests") + 1] == "16"
    expected = {
        "--enable-dp-attention",
        "--disable-cuda-graph",
        "--enable-weights-cpu-backup",
        "--enable-return-routed-experts",
    }
    assert expected <= set(argv)


def test_the_default_gpu_engine_keeps_sglangs_own_defaults(sglang_flags):
    argv = compile_design(compose(GPU)).engines[0].launch.argv
    assert set(flags_of(argv)) <= sglang_flags
    assert not {"--disable-cuda-graph", "--quantization", "--enable-dp-attention"} & set(argv)


def test_engine_parallelism_reaches_the_command_line(sglang_flags):
    plan = compile_design(compose(["cluster=h100_1x8", "engine=sglang", "engine.tp_size=4", "engine.ep_size=2"]))
    argv = plan.engines[0].launch.argv
    assert set(flags_of(argv)) <= sglang_flags
    assert (argv[argv.index("--tp-size") + 1], argv[argv.index("--ep-size") + 1]) == ("4", "2")
    assert len(plan.engines) == 8 // 4
