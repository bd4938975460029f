"""The run's key: `security.api_key_env` names an environment variable (plan/secrets.py)."""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import Finding, rule
from miles_runner.plan.secrets import SETTING, env_name_problem


@rule("api-key-env-is-a-variable-name")
def api_key_env_is_a_variable_name(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if problem := env_name_problem(cfg.security.api_key_env):
        yield Finding(
            (SETTING,),
            f"{problem}. It names the variable that holds the run's key; the key itself never goes in the plan.",
            f"{SETTING}=MILES_API_KEY",
        )
