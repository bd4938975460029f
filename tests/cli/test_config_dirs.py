"""The user's own config folders: `--config-dir DIR` and Hydra's `hydra.searchpath`, for runs, plans, sweeps
and `--recipes`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_runner.cli.main import main, split_config_dirs
from miles_runner.config.compose import RECIPES_DIR, compose
from miles_runner.config.sources import searchpath_entries, with_searchpath
from miles_runner.plan.record import read_plan

pytestmark = pytest.mark.integration

USER_RECIPE = """\
# @package _global_
# My recipe: the CPU default on my own model option, three steps.
defaults:
  - /recipe/tiny_lora_agentic
  - override /model: my_moe

run:
  name: my_recipe
algorithm:
  num_steps: 3
"""


@pytest.fixture
def user_dir(tmp_path) -> Path:
    """A user's config folder: a recipe of their own, one of the same name as a shipped one, a model option."""
    folder = tmp_path / "my_conf"
    (folder / "recipe").mkdir(parents=True)
    (folder / "model").mkdir()
    (folder / "recipe" / "my_recipe.yaml").write_text(USER_RECIPE)
    (folder / "recipe" / "tiny_lora_agentic.yaml").write_text("# @package _global_\n# My copy.\nrun: {name: x}\n")
    (folder / "model" / "my_moe.yaml").write_text(
        (RECIPES_DIR.parent / "model" / "tiny_moe.yaml").read_text().replace("tiny-moe", "my-moe")
    )
    return folder


def only_run_dir(root: Path) -> Path:
    [plan] = list(root.rglob("plan.yaml"))
    return plan.parent


def test_config_dir_flag_is_taken_out_in_both_spellings():
    args = ["--config-dir", "a", "x=1", "--config-dir=b", "--plan"]
    assert split_config_dirs(args) == (["a", "b"], ["x=1", "--plan"])


def test_config_dir_becomes_an_absolute_searchpath_entry_after_the_users_own(tmp_path):
    overrides = with_searchpath(["a=1", "hydra.searchpath=[file:///first]"], [tmp_path])
    assert overrides[0] == "a=1"
    assert searchpath_entries(overrides) == ["file:///first", f"file://{tmp_path}"]


def test_recipes_lists_user_recipes_with_their_folder(user_dir, capsys):
    assert main(["--recipes", "--config-dir", str(user_dir)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    [mine] = [ln for ln in lines if ln.startswith("my_recipe ")]
    assert "My recipe: the CPU default" in mine and mine.endswith(f"[{user_dir}]")
    [shadowed] = [ln for ln in lines if ln.startswith("tiny_lora_agentic ") and str(user_dir) in ln]
    assert "not used: an earlier folder has a recipe of this name" in shadowed
    shipped = [ln for ln in lines if ln.endswith("[shipped]")]
    assert sorted(ln.split()[0] for ln in shipped) == sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_recipes_honours_hydra_searchpath_too(user_dir, capsys):
    assert main(["--recipes", f"hydra.searchpath=[file://{user_dir}]"]) == 0
    assert "my_recipe " in capsys.readouterr().out


def test_a_user_recipe_composes_with_a_user_group_option(user_dir):
    composed = compose(with_searchpath(["+recipe=my_recipe"], [user_dir]))
    assert composed.config.run.name == "my_recipe" and composed.config.algorithm.num_steps == 3
    assert composed.config.model.name == "my-moe"
    assert composed.provenance.choices["model"] == "my_moe"
    assert str(composed.provenance.choice_origins["model"]) == "recipe my_recipe"
    assert composed.searchpath == (f"file://{user_dir}",)


def test_plan_with_config_dir_records_the_search_path(user_dir, tmp_path):
    args = ["+recipe=my_recipe", "--config-dir", str(user_dir), "--plan", f"run.output_root={tmp_path / 'o'}"]
    assert main(args) == 0
    run_dir = only_run_dir(tmp_path / "o")
    assert read_plan(run_dir / "plan.yaml").name == "my_recipe"
    prov = json.loads((run_dir / "provenance.json").read_text())
    assert prov["config_searchpath"] == [f"file://{user_dir}"]
    assert prov["choices"]["model"] == {"option": "my_moe", "from": "recipe my_recipe"}


def test_an_unknown_user_recipe_suggests_the_nearest_one(user_dir, capsys):
    assert main(["+recipe=my_recipy", "--config-dir", str(user_dir), "--plan"]) == 2
    err = capsys.readouterr().err
    assert "unknown-option" in err and "fix: +recipe=my_recipe" in err


@pytest.mark.parametrize("args", [["--config-dir", "no/such/folder"], ["hydra.searchpath=[file:///no/such/folder]"]])
def test_a_missing_config_folder_is_a_problem_not_a_warning(args, capsys):
    assert main(["+recipe=tiny_lora_agentic", *args, "--plan"]) == 2
    err = capsys.readouterr().err
    assert "config-dir-missing" in err and "no/such/folder" in err and "fix:" in err


def test_config_dir_without_a_folder_exits_2(capsys):
    assert main(["--plan", "--config-dir"]) == 2
    assert "--config-dir needs a folder" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_multirun_reads_user_recipes_in_every_job(user_dir, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_runner.cli",
            "--multirun",
            "--plan",
            "+recipe=my_recipe",
            "session=v1,v2",
            "--config-dir",
            str(user_dir),
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    plans = sorted((tmp_path / "sweep").rglob("plan.yaml"))
    assert len(plans) == 2
    assert {read_plan(p).name for p in plans} == {"my_recipe"}
    assert {read_plan(p).session.version for p in plans} == {"v1", "v2"}
