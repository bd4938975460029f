"""The command-line flags `python -m sglang.launch_server` accepts at the pinned release, read from its wheel.

SGLang 0.5.23 declares its server arguments as annotated dataclass fields (`srt/arg_groups/fields/*.py`): each
field `name: A[type, "help" | Arg(...)]` becomes `--name-with-dashes`, or `Arg(cli_name=...)`, plus its
`aliases`, unless `Arg(no_cli=True)` (`arg_groups/arg_utils.add_cli_args_from_dataclass`). A few flags are still
added by hand in `srt/server_args.py` and `srt/arg_groups/*.py`; their `"--..."` literals are read too. Nothing
of SGLang is imported.
"""

from __future__ import annotations

import ast
import zipfile
from functools import cache
from pathlib import Path

FIELDS_DIR = "sglang/srt/arg_groups/fields/"
HAND_WRITTEN = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/")


@cache
def launch_flags(wheel: Path) -> frozenset[str]:
    flags: set[str] = set()
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.endswith(".py"):
                continue
            if name.startswith(FIELDS_DIR):
                flags |= _field_flags(ast.parse(archive.read(name)))
            if name.startswith(HAND_WRITTEN):
                flags |= _literal_flags(ast.parse(archive.read(name)))
    return frozenset(flags)


def _field_flags(tree: ast.Module) -> set[str]:
    flags = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        arg = _arg_call(node.annotation)
        if arg is None and not _has_help_string(node.annotation):
            continue  # not a CLI field
        options = {kw.arg: kw.value for kw in arg.keywords} if arg else {}
        if isinstance(options.get("no_cli"), ast.Constant) and options["no_cli"].value:
            continue
        cli = options.get("cli_name")
        flags.add(cli.value if isinstance(cli, ast.Constant) else "--" + node.target.id.replace("_", "-"))
        if isinstance(aliases := options.get("aliases"), ast.List):
            flags |= {a.value for a in aliases.elts if isinstance(a, ast.Constant)}
    return flags


def _subscript_items(annotation: ast.expr) -> list[ast.expr]:
    """The items of `A[T, meta]` (Annotated under SGLang's alias)."""
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.slice, ast.Tuple):
        return list(annotation.slice.elts)
    return []


def _arg_call(annotation: ast.expr) -> ast.Call | None:
    for item in _subscript_items(annotation)[1:]:
        if isinstance(item, ast.Call) and getattr(item.func, "id", None) == "Arg":
            return item
    return None


def _has_help_string(annotation: ast.expr) -> bool:
    items = _subscript_items(annotation)[1:]
    return any(isinstance(i, ast.Constant | ast.JoinedStr | ast.BinOp) for i in items)


def _literal_flags(tree: ast.Module) -> set[str]:
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("--")
        and " " not in node.value
        and len(node.value) > 2
    }
