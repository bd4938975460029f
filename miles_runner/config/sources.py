"""Where config groups and recipes come from: the shipped config folder first, then the user's folders.

User folders reach Hydra through its own `hydra.searchpath=[...]` override (`miles-run --config-dir DIR` adds
`file://DIR` to it), so a single run, `--plan`, every point of a `--multirun` and the Hydra job of a sweep see
one search path. A user folder is laid out like the shipped one: `recipe/NAME.yaml` adds a recipe
(`+recipe=NAME`), `GROUP/OPTION.yaml` adds an option to a group. Hydra takes a file from the first folder that
has it, so a user file with a shipped file's name is shadowed by the shipped one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from miles_runner.core.errors import Problem
from miles_runner.core.paths import RECIPE_GROUP, conf_dir, shipped

SHIPPED = "miles-runner"  # the label of the shipped config folder
SEARCHPATH_KEY = "hydra.searchpath"
FILE_SCHEME, PKG_SCHEME = "file://", "pkg://"


@dataclass(frozen=True)
class ConfigSource:
    label: str  # SHIPPED, or the search path entry as written
    root: Path | None  # None: an entry that names no readable folder

    @property
    def shipped(self) -> bool:
        return self.label == SHIPPED


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    source: ConfigSource
    shadowed: bool  # an earlier folder has a recipe of this name, so Hydra uses that one


def searchpath_entries(overrides: Sequence[str]) -> list[str]:
    """The entries of the first `hydra.searchpath=[...]` override (the one Hydra uses); [] without one."""
    for text in overrides:
        if text.startswith(SEARCHPATH_KEY + "="):
            try:
                value = OverridesParser.create().parse_overrides([text])[0].value()
            except HydraException:
                return []  # malformed: composition reports it with Hydra's own message
            return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return []


def with_searchpath(overrides: Sequence[str], folders: Sequence[str | Path]) -> list[str]:
    """The overrides with `folders` (absolute `file://` entries) added after any `hydra.searchpath` entries."""
    if not folders:
        return list(overrides)
    entries = searchpath_entries(overrides) + [FILE_SCHEME + str(Path(f).expanduser().absolute()) for f in folders]
    rest = [o for o in overrides if not o.startswith(SEARCHPATH_KEY + "=")]
    return [*rest, searchpath_override(entries)]


def searchpath_override(entries: Sequence[str]) -> str:
    quoted = ("'" + e.replace("'", "\\'") + "'" for e in entries)  # Hydra escapes only quotes in quotes
    return f"{SEARCHPATH_KEY}=[{','.join(quoted)}]"


def entry_root(entry: str) -> Path | None:
    """The folder a search path entry names: `file://DIR`, a bare DIR, or `pkg://module[/sub]`."""
    if entry.startswith(PKG_SCHEME):
        module, _, sub = entry.removeprefix(PKG_SCHEME).partition("/")
        try:
            root = shipped(module, *[p for p in sub.split("/") if p])
        except (ImportError, RuntimeError, TypeError):
            return None
    else:
        root = Path(entry.removeprefix(FILE_SCHEME))
    return root if root.is_dir() else None


def config_sources(searchpath: Sequence[str] = ()) -> list[ConfigSource]:
    """The folders Hydra reads, in its order: the shipped one, then each search path entry."""
    return [ConfigSource(SHIPPED, conf_dir()), *(ConfigSource(e, entry_root(e)) for e in searchpath)]


def missing_folder_problems(searchpath: Sequence[str]) -> list[Problem]:
    """A search path entry that names no folder would be skipped with only a warning; it is an error here."""
    return [
        Problem(
            "config-dir-missing",
            [(f"{SEARCHPATH_KEY}=[{entry}]", "command line")],
            "No such config folder; Hydra would skip it and every recipe or option in it would be unknown.",
            "pass an existing folder (it holds recipe/ and config group folders such as model/)",
        )
        for entry in searchpath
        if entry_root(entry) is None
    ]


def find_option(sources: Sequence[ConfigSource], group: str, option: str) -> Path | None:
    """The file Hydra composes for `group=option` (the first folder that has it)."""
    for source in sources:
        if source.root is not None and (path := source.root / group / f"{option}.yaml").is_file():
            return path
    return None


def group_names(sources: Sequence[ConfigSource]) -> set[str]:
    return {p.name for s in sources if s.root is not None for p in s.root.iterdir() if p.is_dir()}


def group_options(sources: Sequence[ConfigSource], group: str) -> list[str]:
    return sorted({p.stem for s in sources if s.root is not None for p in (s.root / group).glob("*.yaml")})


def recipes(sources: Sequence[ConfigSource]) -> list[Recipe]:
    """Every recipe file of every folder, in search path order, each marked shadowed when an earlier one wins."""
    seen: set[str] = set()
    found = []
    for source in sources:
        if source.root is None:
            continue
        for path in sorted((source.root / RECIPE_GROUP).glob("*.yaml")):
            found.append(Recipe(path.stem, recipe_description(path), source, path.stem in seen))
            seen.add(path.stem)
    return found


def recipe_description(path: Path) -> str:
    """The first comment line of a recipe file that is not its `# @package` header."""
    comments = [ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#")]
    return next((c for c in comments if not c.startswith("@package")), "")


def config_dir_problems(folders: Sequence[str | Path]) -> list[Problem]:
    """`--config-dir DIR` must name an existing folder."""
    return [
        Problem(
            "config-dir-missing",
            [(f"--config-dir {folder}", "command line")],
            "No such folder; its recipes and group options would be unknown.",
            "pass an existing folder (it holds recipe/ and config group folders such as model/)",
        )
        for folder in folders
        if not Path(folder).expanduser().is_dir()
    ]
