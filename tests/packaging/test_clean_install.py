"""`pip install .` (a wheel, not editable) into a fresh venv works with no checkout in reach: from an empty
folder, `miles-run` lists recipes, plans, reads a user's config folder and trains a short real run.

The fresh venv reuses the project venv's third-party packages instead of downloading them again: a `.pth` file
adds a folder of links to every entry of the project's site-packages except miles-runner's own (its editable
finder and dist-info), so the only miles_runner importable is the one pip installed into the fresh venv.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
# What the wheel is built from (pyproject.toml's packages, package data and readme); absent ones are skipped.
BUILD_INPUTS = ("pyproject.toml", "README.md", "miles_runner", "hydra_plugins", "conf", "recipes")
OWN_ENTRIES = ("miles_runner", "__editable__")  # project-venv entries that must not be importable
USER_RECIPE = """\
# @package _global_
# A user's recipe outside the package: the CPU default with two steps.
defaults:
  - /recipe/tiny_lora_agentic
run:
  name: users_own
algorithm:
  num_steps: 2
"""


@dataclass(frozen=True)
class Install:
    venv: Path
    work: Path  # an empty folder: the user's working directory
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [str(self.venv / "bin" / "miles-run"), *args],
            cwd=self.work,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"miles-run {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done


def copy_sources(dest: Path) -> Path:
    """The build inputs only, so the build's own files (build/, *.egg-info) never land in the checkout."""
    dest.mkdir()
    for name in BUILD_INPUTS:
        source = REPO / name
        if source.is_dir():  # symlinks stay links: miles_runner/_resources/conf -> conf, conf/recipe -> recipes
            shutil.copytree(source, dest / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy2(source, dest / name)
    return dest


def linked_dependencies(dest: Path) -> Path:
    """A folder of links to the project venv's site-packages entries, miles-runner's own left out."""
    dest.mkdir()
    site = Path(sysconfig.get_path("purelib"))
    for entry in site.iterdir():
        if not entry.name.startswith(OWN_ENTRIES) and entry.name != "__pycache__":
            (dest / entry.name).symlink_to(entry)
    return dest


def fresh_venv(root: Path, deps: Path) -> Path:
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    # addsitedir, not a bare path: the linked folder's own .pth files (setuptools' distutils hook) take effect too.
    (Path(purelib) / "project_dependencies.pth").write_text(f"import site; site.addsitedir({str(deps)!r})\n")
    return venv


def clean_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["MILES_CACHE_DIR"] = os.environ.get("MILES_CACHE_DIR") or str(REPO / ".cache")  # reuse the tiny model
    env["WANDB_MODE"] = "offline"
    return env


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> Install:
    root = tmp_path_factory.mktemp("clean_install")
    source = copy_sources(root / "src")
    venv = fresh_venv(root, linked_dependencies(root / "deps"))
    env = clean_env(venv)
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            str(source),
        ],
        check=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    work = root / "empty"
    work.mkdir()
    return Install(venv, work, env)


def test_the_installed_package_and_its_config_live_in_the_fresh_venv(install):
    code = (
        "import miles_runner, sys; from miles_runner.core.paths import conf_dir, recipes_dir; "
        "print(miles_runner.__file__); print(conf_dir().resolve()); print(recipes_dir().resolve()); "
        "print(recipes_dir().is_symlink())"
    )
    done = subprocess.run(
        [str(install.venv / "bin" / "python"), "-c", code],
        cwd=install.work,
        env=install.env,
        capture_output=True,
        text=True,
        check=True,
    )
    package, conf, recipes, linked = done.stdout.split()
    for path in (package, conf, recipes):
        assert Path(path).is_relative_to(install.venv) and not Path(path).is_relative_to(REPO), path
    assert linked == "False", "the wheel holds the recipes themselves, not a link into a checkout"


def test_recipes_lists_the_shipped_recipes(install):
    out = install.run("--recipes").stdout
    assert {line.split()[0] for line in out.splitlines()} == {p.stem for p in (REPO / "recipes").glob("*.yaml")}


def test_plan_writes_under_the_working_directorys_outputs(install):
    out = install.run("+recipe=tiny_lora_agentic", "--plan").stdout
    [plan] = list((install.work / "outputs").rglob("plan.yaml"))
    assert "plan tiny_lora_agentic -> outputs/" in out
    provenance = yaml.safe_load((plan.parent / "provenance.json").read_text())
    assert provenance["git"] == {"repo": None, "commit": None, "dirty": None}  # no checkout here
    model_path = yaml.safe_load(plan.read_text())["model_path"]
    assert model_path.startswith(install.env["MILES_CACHE_DIR"]), "tiny models live in the cache folder"


def test_a_user_recipe_in_its_own_folder_composes(install, tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "users_own.yaml").write_text(USER_RECIPE)
    listed = install.run("--recipes", "--config-dir", str(tmp_path)).stdout
    assert any(line.startswith("users_own ") and str(tmp_path) in line for line in listed.splitlines())
    install.run("+recipe=users_own", "--config-dir", str(tmp_path), "--plan", f"hydra.run.dir={tmp_path / 'run'}")
    plan = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert plan["name"] == "users_own"


def test_a_short_real_run_on_a_fresh_machine_builds_its_model_trains_and_records(install, tmp_path):
    # An empty model cache, as on a fresh machine: the run builds its tiny model before anything loads it. The plain
    # tiny-moe, not the recipe's format pre-trained one: the same build path (ensure_format_pretrained builds it
    # first), without 150 pre-training steps.
    cache = tmp_path / "cache"
    install.run(
        "+recipe=tiny_lora_agentic",
        "model.path=tiny:tiny-moe",
        "algorithm.num_steps=1",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "checkpoint.interval=0",
        "logger=none",
        "hydra.run.dir=first_run",
        timeout=300,
        MILES_CACHE_DIR=str(cache),
    )
    run_dir = install.work / "first_run"
    assert (run_dir / "plan.yaml").is_file()
    assert yaml.safe_load((run_dir / "plan.yaml").read_text())["model_path"].startswith(str(cache))
    assert [yaml.safe_load(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0]


def test_the_slurm_launcher_plugin_ships_in_the_wheel(install):
    """Hydra finds hydra/launcher=miles_slurm in the installed wheel (its plugin scan of hydra_plugins)."""
    code = "import hydra_plugins.miles_slurm_launcher.launcher as m; print(m.__file__)"
    done = subprocess.run(
        [str(install.venv / "bin" / "python"), "-c", code],
        cwd=install.work,
        env=install.env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(done.stdout.strip()).is_relative_to(install.venv)
    out = install.run("+recipe=tiny_lora_agentic", "hydra/launcher=miles_slurm", "--plan").stdout
    assert "#SBATCH --nodes=1" in out and "miles_runner.cli.recorded_run" in out
