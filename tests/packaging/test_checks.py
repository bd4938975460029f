"""The static checks: every test run starts with `make check`, and the pre-commit hooks run the same commands,
so that pre-commit's verdict on a commit is the Makefile's (and CI's)."""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def make_rule(target: str) -> tuple[list[str], list[str]]:
    """A Makefile target's prerequisites and commands (with $(BIN) spelled out, as the hooks spell it)."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    prerequisites = lines[start].split(":", 1)[1].split()
    commands = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        commands.append(line.strip().replace("$(BIN)", ".venv/bin"))
    return prerequisites, commands


def check_commands() -> list[str]:
    prerequisites, commands = make_rule("check")
    return [command for target in prerequisites if target != "$(STAMP)" for command in make_rule(target)[1]] + commands


def test_every_test_run_checks_first() -> None:
    for target in ("test", "test-fast"):
        assert "check" in make_rule(target)[0]


def test_pre_commit_runs_the_commands_of_make_check() -> None:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert sorted(hook["entry"] for hook in hooks) == sorted(check_commands())
    assert all(hook["always_run"] and not hook["pass_filenames"] for hook in hooks)  # the whole tree, every time
