"""Plug-ins are chosen by registered name only; unknown names fail with the list of valid ones."""

import pytest

from miles_runner.plugins.lookup import get_agent, get_reward, make_task, registered
from miles_runner.plugins.registry import PluginError, Registry


def test_shipped_plugins_cover_the_names_the_configs_use():
    names = registered()
    assert {"arith", "reverse", "count", "guess_number"} <= set(names["task"])
    assert {"exact_match", "guess_number"} <= set(names["reward"])
    assert "guess_number" in names["agent"]


def test_unknown_task_lists_the_registered_tasks():
    registered = r"registered tasks: arith, count, count_retry, guess_number, jsonl"
    with pytest.raises(PluginError, match=rf"unknown task 'gsm9k'; {registered}"):
        make_task("gsm9k", seed=0)


def test_an_import_path_is_just_an_unknown_name():
    with pytest.raises(PluginError, match=r"unknown reward 'os\.system'"):
        get_reward("os.system")


def test_unknown_agent_is_a_plugin_error():
    with pytest.raises(PluginError, match="registered agents"):
        get_agent("nope")


def test_registering_a_name_twice_is_refused():
    registry: Registry[int] = Registry("widget")
    registry.register("a")(1)
    with pytest.raises(PluginError, match="widget 'a' is already registered"):
        registry.register("a")(2)
