"""provenance.json records the git state of the folder miles-run runs in: an installed package is no checkout."""

import json
import subprocess

from miles_runner.cli.main import main
from miles_runner.plan.record import git_state

NONE = {"repo": None, "commit": None, "dirty": None}


def git(cwd, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_outside_a_checkout_git_is_none(tmp_path):
    assert git_state(tmp_path) == NONE


def test_without_git_installed_git_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert git_state() == NONE


def test_the_working_directorys_checkout_is_recorded_with_its_dirty_state(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("a")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "commit", "-q", "-m", "a")
    assert git_state(tmp_path) == {
        "repo": str(tmp_path.resolve()),
        "commit": git(tmp_path, "rev-parse", "HEAD"),
        "dirty": False,
    }
    (tmp_path / "a.txt").write_text("b")
    assert git_state(tmp_path)["dirty"] is True


def test_a_plan_made_outside_a_checkout_records_no_git(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["+recipe=tiny_lora_agentic", "--plan"]) == 0
    [record] = list((tmp_path / "outputs").rglob("provenance.json"))
    assert json.loads(record.read_text())["git"] == NONE
