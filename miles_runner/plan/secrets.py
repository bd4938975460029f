"""The run's key (`security.api_key_env`): a secret that the plan names but never holds.

The plan records only the NAME of the environment variable that holds the key. Launch lines that need the value
in argv (SGLang's `--api-key`, `sglang-router launch --api-key`: they take it only there) carry a placeholder,
`{secret:NAME}`, that `fill_secrets` replaces when the process is spawned (procs.launch); our own servers get
`--api-key-env NAME` and read the variable themselves, so their argv holds no secret. A run whose variable is
unset or empty is refused before anything starts (`require_run_key`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

SETTING = "security.api_key_env"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PLACEHOLDER = re.compile(r"\{secret:([A-Za-z_][A-Za-z0-9_]*)\}")


class MissingSecretError(RuntimeError):
    """The variable `security.api_key_env` names is unset or empty: the run cannot key its servers."""


def secret_placeholder(env_name: str) -> str:
    """What a plan's argv holds where the value of `env_name` goes."""
    return f"{{secret:{env_name}}}"


def env_name_problem(env_name: str) -> str | None:
    """Why `env_name` cannot name an environment variable, or None when it can (or is "": no key)."""
    if env_name and not ENV_NAME.fullmatch(env_name):
        return f"{env_name!r} is not an environment variable name (letters, digits and '_', not first a digit)"
    return None


def secret_value(env_name: str, environ: Mapping[str, str] | None = None) -> str:
    """The value of `env_name`; MissingSecretError naming the setting and the variable when unset or empty."""
    value = (os.environ if environ is None else environ).get(env_name, "")
    if not value:
        raise MissingSecretError(
            f"{SETTING}={env_name} names the environment variable that holds the run's key, but ${env_name} is "
            f"unset or empty: export {env_name}=<key> before starting the run (or set {SETTING}='' to run "
            "without a key, on loopback only)"
        )
    return value


def run_api_key(env_name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The run's key: None for a run without one (`security.api_key_env` empty), else the variable's value."""
    return secret_value(env_name, environ) if env_name else None


def require_run_key(env_name: str, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a keyed run whose variable is unset or empty (call before starting anything)."""
    run_api_key(env_name, environ)


def fill_secrets(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """`argv` with every `{secret:NAME}` replaced by $NAME (MissingSecretError when it is unset or empty)."""
    return [PLACEHOLDER.sub(lambda m: secret_value(m.group(1), environ), arg) for arg in argv]


def key_environment(env_name: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The run's key as an environment for a process on another node (a Ray actor's runtime_env): {} without a key."""
    return {env_name: secret_value(env_name, environ)} if env_name else {}
