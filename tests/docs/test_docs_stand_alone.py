"""The repository stands alone: docs/ARCHITECTURE.md names only modules and definitions that exist, every cited docs
section exists, and no tracked file points outside the checkout or cites an issue number.

ARCHITECTURE.md's notation, which the checks below read:
- a path of the tree (`miles_runner/...`, `tests/...`, `hydra_plugins/...`, `miles_testkit/...`, `bench/...`) names
  a file or folder that exists; a file name after it (`verify.py, probe.py`, `single_turn.py | agentic.py`) is a
  sibling in the same folder;
- `pkg/mod.py` (`name`, `Class.member`): each name is defined in that module (a def, a class or an assignment at its
  top level; a member: a method, field or assignment in the class body);
- `pkg/` (`a.py`, `sub/`): each is a file or folder of that package;
- in a code block, `pkg/mod.py    Name: what it does` names `Name` in that module too;
- elsewhere, a class in backticks (`NodeLostError`, `AgentHandle.lost`) is a class of `miles_runner/` (and that
  member of it), and a rule id in backticks (`local-executor-is-one-node`) is a rule of `miles_runner/plan/rules/`.

Modules are parsed (ast), never imported, so that the test stays fast and needs none of the heavy libraries.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

TREE_PATH = r"(?:miles_runner|tests|hydra_plugins|miles_testkit|bench)/[\w/.-]*[\w/]"
IDENT = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?"
# `path` (`a`, `b`) or, in a code block, path (a)
NAMES_AFTER_PATH = re.compile(rf"`?({TREE_PATH})`?\s\(([^()]*)\)")
# in a code block: path, two or more spaces, then `Name:` (or `Name.member:`)
NAME_COLUMN = re.compile(rf"^\s*(?:→ )?({TREE_PATH}\.py) {{2,}}({IDENT}):", re.M)
SIBLINGS = re.compile(rf"({TREE_PATH}\.py)((?:(?:, | \| )\w+\.py)+)")
LIST_ITEM = re.compile(r"`?([\w.]+/?)`?")

# Pieces are joined here so that this file's own text holds none of what it looks for.
OUTSIDE = ("/" + "work/", "/" + "root/", ".." + "/shared")
ISSUE_CITATION = re.compile(r"\bissues?\s+#?\d+", re.I)


def doc_text() -> str:
    return ARCHITECTURE.read_text()


def code_blocks(text: str) -> str:
    return "\n".join(text.split("```")[1::2])


def name_lists(text: str) -> list[tuple[str, list[str]]]:
    """(path, names) for every `path (names)` whose parentheses hold only a list of names (not prose)."""
    found = []
    for match in NAMES_AFTER_PATH.finditer(text):
        items = [item.strip() for item in match.group(2).split(",")]
        names = [m.group(1) for item in items if (m := LIST_ITEM.fullmatch(item))]
        if names and len(names) == len(items):
            found.append((match.group(1), names))
    return found


@cache
def definitions(module: str) -> frozenset[str]:
    """Top-level names a module defines, and `Class.member` for the members of its classes."""
    tree = ast.parse((ROOT / module).read_text(), filename=module)
    names: set[str] = set()

    def bound(node: ast.stmt) -> list[str]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return [node.name]
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        return [t.id for t in targets if isinstance(t, ast.Name)]

    for node in tree.body:
        names.update(bound(node))
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{member}" for child in node.body for member in bound(child))
    return frozenset(names)


def test_every_path_in_architecture_exists():
    text = doc_text()
    paths = set(re.findall(TREE_PATH, text))
    assert paths, "docs/ARCHITECTURE.md names no module: the pattern above no longer reads it"
    for match in SIBLINGS.finditer(text):
        folder = match.group(1).rsplit("/", 1)[0]
        paths.update(f"{folder}/{name}" for name in re.findall(r"\w+\.py", match.group(2)))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_name_in_architecture_is_defined_where_it_says():
    text = doc_text()
    pairs = name_lists(text) + [(m.group(1), [m.group(2)]) for m in NAME_COLUMN.finditer(code_blocks(text))]
    assert len(pairs) >= 10, f"only {len(pairs)} `module (names)` pairs read: has the notation changed?"
    wrong = []
    for path, names in pairs:
        for name in names:
            if path.endswith("/"):
                if not (ROOT / path / name).exists():
                    wrong.append(f"{path}{name} (no such file or folder)")
            elif path.endswith(".py"):
                if name not in definitions(path):
                    wrong.append(f"{path} ({name}): not defined there")
            else:
                wrong.append(f"{path} ({name}): names follow a module (.py) or a package (/)")
    assert not wrong, "docs/ARCHITECTURE.md is out of step with the code:\n" + "\n".join(wrong)


@cache
def package_classes() -> frozenset[str]:
    """Every class of miles_runner/, and `Class.member` for its members."""
    found: set[str] = set()
    for path in (ROOT / "miles_runner").rglob("*.py"):
        names = definitions(path.relative_to(ROOT).as_posix())
        classes = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
        found |= {name for name in names if name.split(".")[0] in classes}
    return frozenset(found)


def test_every_class_and_rule_named_in_architecture_exists():
    quoted = set(re.findall(r"`([^`\s]+)`", doc_text()))
    classes = {name for name in quoted if re.fullmatch(r"[A-Z][a-z]\w*(?:\.[a-z_]\w*)?", name)}
    rule_ids = {name for name in quoted if re.fullmatch(r"[a-z0-9]+(?:-[a-z0-9]+){2,}", name)}
    assert classes and rule_ids, "no class or rule id read from docs/ARCHITECTURE.md: has the notation changed?"
    rules_source = "\n".join(path.read_text() for path in (ROOT / "miles_runner/plan/rules").glob("*.py"))
    registered = set(re.findall(r'@rule\("([\w-]+)"', rules_source))
    wrong = sorted(classes - package_classes()) + sorted(rule_ids - registered)
    assert not wrong, f"docs/ARCHITECTURE.md names classes or rules that miles_runner/ does not have: {wrong}"


def tracked_text_files() -> list[tuple[str, str]]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in filter(None, listed.decode().split("\0")):
        path = ROOT / name
        if name == THIS_FILE or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        try:
            files.append((name, data.decode()))
        except UnicodeDecodeError:
            continue
    return files


def test_no_tracked_file_points_outside_the_repository():
    found = [
        f"{name}:{number}: {line.strip()[:100]}"
        for name, text in tracked_text_files()
        for number, line in enumerate(text.splitlines(), 1)
        if any(piece in line for piece in OUTSIDE)
    ]
    assert not found, "paths of one machine, or outside the checkout (cite a docs/ page instead):\n" + "\n".join(found)


def test_every_cited_docs_section_exists():
    """A comment cites a page and section (`docs/system.md §4.3`): the page has a heading of that number."""
    citations = {
        (name, page, section)
        for name, text in tracked_text_files()
        for page, section in re.findall(r"(docs/[\w-]+\.md)\s+§(\d+(?:\.\d+)?)", text)
    }
    assert citations, "no `docs/<page>.md §N` citation found"
    wrong = []
    for name, page, section in sorted(citations):
        doc = ROOT / page
        numbers = set(re.findall(r"^#{2,4} (\d+(?:\.\d+)?)[. ]", doc.read_text(), re.M)) if doc.is_file() else set()
        if section not in numbers:
            wrong.append(f"{name}: {page} §{section}")
    assert not wrong, "citations of docs sections that do not exist:\n" + "\n".join(wrong)


def comments_and_docstrings(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    found = [(tok.start[0], tok.string) for tok in tokens if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                found.append((node.body[0].lineno, docstring))
    return found


def test_no_python_comment_cites_an_issue_number():
    found = [
        f"{name}:{line}: {match.group(0)}"
        for name, text in tracked_text_files()
        if name.endswith(".py")
        for line, comment in comments_and_docstrings(text)
        for match in ISSUE_CITATION.finditer(comment)
    ]
    assert not found, "comments cite issue numbers a reader cannot look up (cite a docs/ section):\n" + "\n".join(found)
