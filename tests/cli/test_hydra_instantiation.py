"""A config file cannot make Hydra create a class: callbacks, a launcher or sweeper that is not an installed
plugin, and logging handlers are refused before any sweep starts, `--plan` included."""

import pytest

from miles_runner.cli.main import main
from miles_testkit.plan_errors import printed_rules as rules

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

SWEEP = ["--multirun", "--plan", "rollout.rollout_batch_size=2,4"]


def user_folder(tmp_path, relative: str, text: str):
    path = tmp_path / "conf" / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return ["--config-dir", str(tmp_path / "conf")]


def recipe_with_hydra_node(tmp_path, node: str):
    marker = tmp_path / "created.txt"
    body = f"# @package _global_\n# a hostile recipe\nhydra:\n{node.format(marker=marker)}"
    return [*user_folder(tmp_path, "recipe/hostile.yaml", body), "+recipe=hostile"], marker


CALLBACK = "  callbacks:\n    x:\n      _target_: logging.FileHandler\n      filename: {marker}\n"
LOGGING = "  job_logging:\n    handlers:\n      f:\n        class: logging.FileHandler\n        filename: {marker}\n"


@pytest.mark.parametrize(("node", "rule"), [(CALLBACK, "hydra-callbacks-refused"), (LOGGING, "hydra-logging-refused")])
def test_a_recipe_that_would_make_hydra_create_a_class_is_refused_and_nothing_is_created(tmp_path, capsys, node, rule):
    args, marker = recipe_with_hydra_node(tmp_path, node)
    assert main([*args, *SWEEP, f"hydra.sweep.dir={tmp_path / 'sweep'}"]) == 2
    assert rule in rules(capsys.readouterr().err)
    assert not marker.exists() and not (tmp_path / "sweep").exists()


def test_a_single_run_refuses_them_too_rather_than_ignoring_them(tmp_path, capsys):
    args, _ = recipe_with_hydra_node(tmp_path, CALLBACK)
    assert main([*args, f"hydra.run.dir={tmp_path / 'run'}", "--plan"]) == 2
    assert rules(capsys.readouterr().err) == ["hydra-callbacks-refused"]


def test_a_launcher_from_a_user_folder_must_be_an_installed_plugin(tmp_path, capsys):
    marker = tmp_path / "created.txt"
    args = user_folder(tmp_path, "hydra/launcher/hostile.yaml", f"_target_: logging.FileHandler\nfilename: {marker}\n")
    assert main([*args, *SWEEP, "hydra/launcher=hostile"]) == 2
    err = capsys.readouterr().err
    assert set(rules(err)) == {"hydra-launcher-not-a-plugin"} and "BasicLauncher" in err  # once per sweep point
    assert not marker.exists()


def test_the_shipped_launchers_still_compose(tmp_path):
    assert main([*SWEEP, "hydra/launcher=submitit_local", f"hydra.sweep.dir={tmp_path}"]) == 0
