"""Where shipped config and the user's cache are: importlib.resources for the one, the environment for the other."""

from pathlib import Path

import pytest

from miles_runner.config.compose import CONF_DIR, RECIPES_DIR
from miles_runner.core import paths
from miles_runner.plan.derive import resolve_data_path, resolve_model_path


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv(paths.CACHE_ENV, raising=False)
    monkeypatch.delenv(paths.XDG_CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_shipped_config_is_package_data_with_the_recipes_as_its_recipe_group():
    assert paths.conf_dir() == CONF_DIR and paths.recipes_dir() == RECIPES_DIR
    assert (CONF_DIR / "config.yaml").is_file() and (RECIPES_DIR / "tiny_lora_agentic.yaml").is_file()
    assert CONF_DIR.is_relative_to(paths.package_dir())


def test_cache_defaults_to_the_users_cache_folder(clean_env, tmp_path):
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "miles-runner"


def test_xdg_cache_home_is_used_when_absolute(clean_env, tmp_path):
    clean_env.setenv(paths.XDG_CACHE_ENV, str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "miles-runner"
    clean_env.setenv(paths.XDG_CACHE_ENV, "relative/xdg")  # invalid by the XDG spec: ignored
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "miles-runner"


def test_miles_cache_dir_wins_and_is_made_absolute(clean_env, tmp_path):
    clean_env.setenv(paths.XDG_CACHE_ENV, str(tmp_path / "xdg"))
    clean_env.setenv(paths.CACHE_ENV, str(tmp_path / "mine"))
    assert paths.cache_dir() == tmp_path / "mine"
    clean_env.chdir(tmp_path)
    clean_env.setenv(paths.CACHE_ENV, "rel")
    assert paths.cache_dir() == tmp_path / "rel"


def test_tiny_models_resolve_into_the_cache_and_bundled_data_into_the_package(clean_env, tmp_path):
    clean_env.setenv(paths.CACHE_ENV, str(tmp_path / "c"))
    assert resolve_model_path("tiny:tiny-moe:format") == str(tmp_path / "c" / "models" / "tiny-moe-seed0-format")
    assert Path(resolve_data_path("bundled:letters.jsonl")) == paths.bundled_data_dir() / "letters.jsonl"
    assert paths.bundled_data_dir().is_relative_to(paths.package_dir())
