"""What compose() does around Hydra to save time, checked against Hydra's own result: the per-compose copy of the
config repository shares the ConfigStore singleton (only within a compose), and the job's tree is converted
without copying the config first."""

import copy

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from miles_runner.config import compose as compose_module

OVERRIDE_SETS = [
    [],
    ["+recipe=glm52_lora_agentic"],
    ["topology=disaggregated", "session=off", "rollout.temperature=0.7"],
    ["+recipe=qwen3_30b_a3b_r3_session", "adapters=multi"],
]


def composed_by_hydra_alone(overrides: list[str]) -> dict:
    """What Hydra composes with its own repository copy (the store copied too)."""
    with initialize_config_dir(config_dir=str(compose_module.CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    return OmegaConf.to_container(cfg, resolve=False)


@pytest.mark.parametrize("overrides", OVERRIDE_SETS, ids=lambda o: " ".join(o) or "defaults")
def test_sharing_the_store_composes_exactly_what_hydra_composes(overrides, tmp_path, monkeypatch):
    compose_module.register_base()
    monkeypatch.chdir(tmp_path)  # hydra.runtime.cwd is part of the tree: the same folder for both
    shared = OmegaConf.to_container(compose_module._hydra_compose(overrides), resolve=False)
    assert shared == composed_by_hydra_alone(overrides)


def test_the_store_is_shared_only_inside_the_block_even_when_it_raises():
    store = ConfigStore.instance()
    with compose_module._config_store_shared_by_copies():
        assert copy.deepcopy({"store": store})["store"] is store
    with pytest.raises(RuntimeError), compose_module._config_store_shared_by_copies():
        raise RuntimeError("a failed compose")
    assert not hasattr(ConfigStore, "__deepcopy__")
    assert copy.deepcopy(store) is not store


def test_the_job_tree_is_the_whole_config_as_data_without_hydras_node():
    cfg = OmegaConf.create(
        {
            "hydra": {"run": {"dir": "out"}},
            "rollout": {"batch": 8, "steps": "${algorithm.steps}", "note": "${hydra.run.dir}", "todo": "???"},
            "algorithm": {"steps": 3, "names": ["a", "${rollout.batch}"]},
            "flag": "${algorithm.steps}",
            "unset": "???",
        }
    )
    whole = OmegaConf.to_container(cfg, resolve=True)
    del whole["hydra"]
    assert compose_module.job_tree(cfg) == whole
    assert whole["rollout"]["note"] == "out" and whole["algorithm"]["names"] == ["a", 8] and whole["unset"] == "???"
