"""Every flag a plan renders for a real SGLang engine is one that the pinned `sglang.launch_server` defines, and
each engine.* GPU setting reaches that command line (the embedded engine refuses them: see the plan rules).

GPU plans are compiled as designs: this release refuses them until a trainer that trains on GPUs is built
(fsdp-trainer-on-gpus-not-built, megatron-trainer-not-built), and their engine command lines are the ones a
GPU release will start."""

import pytest

from miles_runner.config.compose import RECIPES_DIR, compose
from miles_runner.plan.compile import compile_design
from miles_testkit.contract.sglang_args import launch_flags
from miles_testkit.contract.sglang_spec import pinned_wheel

GPU = ["cluster=gpu_1x", "engine=sglang"]
GPU_SETTINGS = [
    *GPU, "engine.mem_fraction_static=0.7", "engine.dp_attention=true", "engine.enable_cuda_graph=false",
    "engine.fp8_rollout=true", "engine.lora_backend=csgmv", "engine.extra_args=[--max-running-requests,16]",
    "adapters.base_cpu_backup=true", "rollout.routing_replay=true", "engine.ep_size=1",
]  # fmt: skip
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
    for engine in plan.engines:
        if "sglang.launch_server" in engine.launch.argv:
            assert set(flags_of(engine.launch.argv)) <= sglang_flags, engine.launch.argv


def test_each_gpu_engine_setting_reaches_the_sglang_command_line(sglang_flags):
    argv = compile_design(compose(GPU_SETTINGS)).engines[0].launch.argv
    assert set(flags_of(argv)) <= sglang_flags, argv
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.7"
    assert argv[argv.index("--dp-size") + 1] == argv[argv.index("--tp-size") + 1]
    assert argv[argv.index("--quantization") + 1] == "fp8"
    assert argv[argv.index("--lora-backend") + 1] == "csgmv"
    assert argv[argv.index("--max-running-requests") + 1] == "16"
    expected = {"--enable-dp-attention", "--disable-cuda-graph", "--enable-weights-cpu-backup",
                "--enable-return-routed-experts"}  # fmt: skip
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
