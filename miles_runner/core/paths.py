"""The one place that knows where miles-runner's files are: shipped config, shipped data, the model cache.

Shipped files are found with `importlib.resources`, so they are the same in a git checkout, an editable install
and a wheel (`miles_runner/_resources/conf` is a symlink to the repository's `conf/` in a checkout and a copy
in a wheel). Whatever miles-runner writes (built tiny models) goes to one cache folder, never into the package:
`$MILES_CACHE_DIR` if set; else, run from a source checkout (an editable install, as `make` makes), the checkout's
git-ignored `.cache/`, the folder the Makefile uses too, so `make run` and `.venv/bin/miles-run` build each model once
and each checkout keeps the models its own code built; else the user's `$XDG_CACHE_HOME/miles-runner`, else
`~/.cache/miles-runner`.
"""

from __future__ import annotations

import os
from functools import cache
from importlib.resources import files
from pathlib import Path

PACKAGE = "miles_runner"
RESOURCES = "miles_runner._resources"
CACHE_ENV = "MILES_CACHE_DIR"
XDG_CACHE_ENV = "XDG_CACHE_HOME"
CACHE_NAME = "miles-runner"
CHECKOUT_CACHE = ".cache"  # in a source checkout, beside pyproject.toml (the Makefile's MILES_CACHE_DIR default)
RECIPE_GROUP = "recipe"  # the config group of `+recipe=NAME`: conf/recipe (a symlink to recipes/)


def shipped(package: str, *parts: str) -> Path:
    """A file or folder shipped in `package`, as a filesystem path (Hydra reads config folders from disk)."""
    resource = files(package).joinpath(*parts)
    if not isinstance(resource, Path):
        raise RuntimeError(
            f"{package} is not installed as plain files ({resource!r}); install miles-runner with `pip install`"
            " into a folder, not into a zip archive"
        )
    return resource


@cache
def package_dir() -> Path:
    """The installed `miles_runner` package folder."""
    return shipped(PACKAGE)


@cache
def conf_dir() -> Path:
    """The shipped Hydra config folder: `config.yaml` and one subfolder per config group."""
    return shipped(RESOURCES, "conf")


def recipes_dir() -> Path:
    """The shipped recipes: the `recipe` group of the shipped config folder."""
    return conf_dir() / RECIPE_GROUP


def bundled_data_dir() -> Path:
    """Prompt sets shipped with the package (`bundled:NAME` in a config)."""
    return package_dir() / "plugins" / "data"


@cache
def source_checkout() -> Path | None:
    """The source checkout the package runs from (its folder beside pyproject.toml: an editable install, or the
    checkout on sys.path), or None for an installed wheel."""
    root = package_dir().parent
    return root if (root / "pyproject.toml").is_file() else None


def cache_dir() -> Path:
    """Where miles-runner keeps what it builds: $MILES_CACHE_DIR, else a source checkout's .cache/, else
    $XDG_CACHE_HOME/miles-runner, else ~/.cache/miles-runner. Read on every call, so a changed environment takes
    effect."""
    if own := os.environ.get(CACHE_ENV):
        return Path(own).expanduser().absolute()
    if checkout := source_checkout():
        return checkout / CHECKOUT_CACHE
    xdg = os.environ.get(XDG_CACHE_ENV, "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"  # XDG: relative is invalid
    return base / CACHE_NAME


def model_cache_dir() -> Path:
    """Built tiny models: `<cache>/models`."""
    return cache_dir() / "models"
