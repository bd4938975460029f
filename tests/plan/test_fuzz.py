"""Override fuzz: any combination of group options and values yields a Plan or a PlanError, nothing else."""

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_runner.config.compose import CONF_DIR, RECIPES_DIR, compose
from miles_runner.core.errors import PlanError
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan

GROUPS = {
    p.name: sorted(f.stem for f in p.glob("*.yaml")) for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "recipe"
}
RECIPES = sorted(p.stem for p in Path(RECIPES_DIR).glob("*.yaml"))
KEYS = [
    "trainer.parallel.tp", "trainer.parallel.pp", "trainer.parallel.ep", "trainer.parallel.cp", "engine.tp_size",
    "engine.ep_size", "topology.actor_num_gpus_per_node", "topology.rollout_num_gpus", "cluster.nodes",
    "cluster.gpus_per_node", "rollout.n_samples_per_prompt", "rollout.rollout_batch_size", "adapters.rank",
    "algorithm.global_batch_size", "rollout.max_weight_staleness", "adapters.max_slots", "session.port",
]
FLAGS = ["rollout.fully_async", "rollout.routing_replay", "rollout.partial_rollout", "adapters.train_only",
         "trainer.calculate_per_token_loss", "rollout.group_rm", "cluster.cpu_only"]
VALUES = st.sampled_from(["0", "1", "2", "3", "4", "8", "16", "-1", "x", "true", "1.5", "null", "[1]"])

group_override = st.sampled_from(sorted(GROUPS)).flatmap(lambda g: st.sampled_from(GROUPS[g]).map(lambda o: f"{g}={o}"))
key_override = st.tuples(st.sampled_from(KEYS), VALUES).map("=".join)
flag_override = st.tuples(st.sampled_from(FLAGS), st.sampled_from(["true", "false", "maybe"])).map("=".join)
recipe = st.one_of(st.none(), st.sampled_from(RECIPES)).map(lambda r: [f"+recipe={r}"] if r else [])
overrides = st.tuples(recipe, st.lists(st.one_of(group_override, key_override, flag_override), max_size=6))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides)
def test_any_override_combination_gives_a_plan_or_a_plan_error(drawn):
    head, rest = drawn
    try:
        result = compile_plan(compose(head + rest))
    except PlanError as exc:
        assert exc.problems, "a PlanError always carries at least one problem"
        assert all(p.rule for p in exc.problems)
        return
    assert isinstance(result, Plan)
    assert result.engines, "a valid plan starts at least one engine"
