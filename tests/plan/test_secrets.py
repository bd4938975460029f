"""The run's key in the plan (plan/secrets.py): names and placeholders in the plan, the value only at spawn time."""

from __future__ import annotations

import pytest

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_design, compile_plan
from miles_runner.plan.model import plan_to_dict
from miles_runner.plan.render import engine_key_flags
from miles_runner.plan.secrets import MissingSecretError, fill_secrets, run_api_key, secret_placeholder
from miles_runner.plan.summary import summarize

pytestmark = pytest.mark.reliability

KEY_ENV = "MILES_TEST_KEY"


def test_a_placeholder_is_filled_from_the_environment_and_other_arguments_stay():
    argv = ["sglang-router", "--api-key", secret_placeholder(KEY_ENV), "--port", "1"]
    assert fill_secrets(argv, {KEY_ENV: "v"}) == ["sglang-router", "--api-key", "v", "--port", "1"]


@pytest.mark.parametrize("environ", [{}, {KEY_ENV: ""}])
def test_an_unset_or_empty_variable_is_refused_naming_the_setting_and_the_variable(environ):
    with pytest.raises(MissingSecretError, match=rf"security.api_key_env={KEY_ENV} .*\${KEY_ENV} is unset or empty"):
        fill_secrets(["--api-key", secret_placeholder(KEY_ENV)], environ)
    with pytest.raises(MissingSecretError):
        run_api_key(KEY_ENV, environ)


def test_a_run_without_a_key_needs_no_variable():
    assert run_api_key("", {}) is None


def test_sglang_takes_a_placeholder_and_our_engine_the_variables_name():
    assert engine_key_flags("sglang", KEY_ENV) == ["--api-key", "{secret:MILES_TEST_KEY}"]
    assert engine_key_flags("embedded", KEY_ENV) == ["--api-key-env", KEY_ENV]
    assert engine_key_flags("sglang", "") == engine_key_flags("embedded", "") == []


def test_every_server_of_a_keyed_plan_gets_the_key_and_the_plan_holds_no_value(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "the-value-itself")
    plan = compile_design(
        compose(["cluster=gpu_1x", "engine=sglang", "router=sglang", "session=v1", f"security.api_key_env={KEY_ENV}"])
    )
    placeholder = secret_placeholder(KEY_ENV)
    assert plan.engines[0].launch.argv[-2:] == ["--api-key", placeholder]
    assert plan.router.launch.argv[-2:] == ["--api-key", placeholder]
    assert plan.session.launch.argv[-2:] == ["--api-key-env", KEY_ENV]
    assert "the-value-itself" not in str(plan_to_dict(plan)) + summarize(plan, "plan.yaml")
    assert "auth       bearer key from $MILES_TEST_KEY" in summarize(plan, "plan.yaml")


def test_a_plan_without_a_key_says_its_servers_are_open_on_loopback():
    plan = compile_plan(compose([]))
    assert plan.security.api_key_env == ""
    assert " auth       none (loopback only)" in summarize(plan, "plan.yaml")
    assert not [a for e in plan.engines for a in e.launch.argv if "api-key" in a]
