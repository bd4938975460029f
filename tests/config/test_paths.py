"""Where shipped config and the model cache are: importlib.resources for the one, the environment and the source
checkout (if any) for the other."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miles_runner.config.compose import CONF_DIR, RECIPES_DIR
from miles_runner.core import paths
from miles_runner.plan.derive import resolve_data_path, resolve_model_path

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv(paths.CACHE_ENV, raising=False)
    monkeypatch.delenv(paths.XDG_CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


@pytest.fixture
def installed(clean_env):
    """The package as a wheel installs it: no source checkout around it."""
    clean_env.setattr(paths, "source_checkout", lambda: None)
    return clean_env


def test_shipped_config_is_package_data_with_the_recipes_as_its_recipe_group():
    assert paths.conf_dir() == CONF_DIR and paths.recipes_dir() == RECIPES_DIR
    assert (CONF_DIR / "config.yaml").is_file() and (RECIPES_DIR / "tiny_lora_agentic.yaml").is_file()
    assert CONF_DIR.is_relative_to(paths.package_dir())


def test_an_installed_packages_cache_defaults_to_the_users_cache_folder(installed, tmp_path):
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "miles-runner"


def test_xdg_cache_home_is_used_when_absolute(installed, tmp_path):
    installed.setenv(paths.XDG_CACHE_ENV, str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "miles-runner"
    installed.setenv(paths.XDG_CACHE_ENV, "relative/xdg")  # invalid by the XDG spec: ignored
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "miles-runner"


def test_run_from_a_checkout_the_cache_is_the_checkouts_own_whatever_the_users_cache_folder(clean_env, tmp_path):
    clean_env.setenv(paths.XDG_CACHE_ENV, str(tmp_path / "xdg"))
    assert paths.source_checkout() == REPO
    assert paths.cache_dir() == REPO / ".cache"


def test_miles_cache_dir_wins_and_is_made_absolute(clean_env, tmp_path):
    clean_env.setenv(paths.XDG_CACHE_ENV, str(tmp_path / "xdg"))
    clean_env.setenv(paths.CACHE_ENV, str(tmp_path / "mine"))
    assert paths.cache_dir() == tmp_path / "mine"  # over the checkout's cache too
    clean_env.chdir(tmp_path)
    clean_env.setenv(paths.CACHE_ENV, "rel")
    assert paths.cache_dir() == tmp_path / "rel"


def test_tiny_models_resolve_into_the_cache_and_bundled_data_into_the_package(clean_env, tmp_path):
    clean_env.setenv(paths.CACHE_ENV, str(tmp_path / "c"))
    assert resolve_model_path("tiny:tiny-moe:format") == str(tmp_path / "c" / "models" / "tiny-moe-seed0-format")
    assert Path(resolve_data_path("bundled:letters.jsonl")) == paths.bundled_data_dir() / "letters.jsonl"
    assert paths.bundled_data_dir().is_relative_to(paths.package_dir())


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_the_console_script_keeps_models_where_the_makefile_builds_them(tmp_path):
    """`make run` (or `make tiny-models`) then the README's `.venv/bin/miles-run` commands: one cache, so nothing is
    built twice. Neither is told where: no MILES_CACHE_DIR, and a user cache folder elsewhere."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k != paths.CACHE_ENV} | {paths.XDG_CACHE_ENV: str(tmp_path / "xdg")}
    rule = "print-miles-cache-dir: ; @echo $(MILES_CACHE_DIR)"
    make = [shutil.which("make"), "-s", "--no-print-directory", "-C", str(REPO), "--eval", rule]
    made = subprocess.run([*make, "print-miles-cache-dir"], env=env, capture_output=True, text=True, check=True)
    makefile_cache = Path(made.stdout.strip())
    run_dir = tmp_path / "run"
    miles_run = [str(Path(sys.executable).with_name("miles-run")), "+recipe=tiny_lora_agentic", "--plan"]
    subprocess.run([*miles_run, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, capture_output=True, check=True)
    model_path = Path(yaml.safe_load((run_dir / "plan.yaml").read_text())["model_path"])
    assert makefile_cache == REPO / ".cache"
    assert model_path.parent == makefile_cache / "models"
