"""References that resolve: every ``sess.…`` dotted name and every repo path that README.md, docs/,
conf/ and the product's docstrings mention exists, and every relative Markdown link reaches a file
and, with ``#anchor``, one of its headings. A file moved or a function renamed fails here, not in a
reader's hands. Names are resolved by reading the source (no imports): a module or package, then a
name it defines or imports at top level, then a member of that class."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cli", "conf", "engine", "harness", "loops", "rl", "sandbox", "tasks")
DOTTED = re.compile(r"(?<![\w./-])sess(?:\.[A-Za-z_]\w*)+")
# a path in this repository: one of its top folders, then what follows (`*` globs allowed)
REPO_PATH = re.compile(
    rf"(?<![\w./<-])(?:{'|'.join((*PACKAGES, 'tests', 'docs', 'benchmarks'))})/[\w./*-]*[\w*/]"
)
LINK = re.compile(r"\]\((?!https?:|mailto:)([^)\s]*)\)")


def _documents() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "conf").rglob("*.yaml")),
    ]


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [
        doc
        for node in ast.walk(tree)
        if isinstance(node, kinds) and (doc := ast.get_docstring(node, clean=False))
    ]


def _texts() -> list[tuple[Path, str]]:
    texts = [(path, path.read_text()) for path in _documents()]
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            texts += [(path, doc) for doc in _docstrings(path)]
    return texts


@cache
def _top_level(path: Path) -> dict[str, ast.ClassDef | None]:
    """The names a module defines or imports at top level; a class maps to its node."""
    names: dict[str, ast.ClassDef | None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update((n.id, None) for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update(((a.asname or a.name).split(".")[0], None) for a in node.names)
    return names


def _members(cls: ast.ClassDef) -> set[str]:
    found = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return found


def resolves(dotted: str) -> bool:
    """Whether ``sess.a.b.Name.member`` names a module of this tree, then a name in it, then a member
    of that class (a class with bases may inherit the member: accepted)."""
    parts, here = dotted.split(".")[1:], ROOT
    while parts and ((here / parts[0]).is_dir() or (here / f"{parts[0]}.py").is_file()):
        here = here / parts[0] if (here / parts[0]).is_dir() else here / f"{parts[0]}.py"
        parts = parts[1:]
    if here == ROOT:
        return False
    module = here / "__init__.py" if here.is_dir() else here
    if not parts:
        return True
    if not module.is_file() or parts[0] not in (names := _top_level(module)):
        return False
    cls = names[parts[0]]
    return len(parts) == 1 or cls is None or bool(cls.bases) or parts[1] in _members(cls)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def dangling(path: Path, text: str) -> list[str]:
    """The references in ``text`` (found in ``path``) that name nothing."""
    found = [m.group(0) for m in DOTTED.finditer(text) if not resolves(m.group(0))]
    for m in REPO_PATH.finditer(text):
        rel = m.group(0).rstrip(".")
        if not (ROOT / rel).exists() and not any(ROOT.glob(rel)):
            found.append(rel)
    if path.suffix == ".md":
        for m in LINK.finditer(text):
            target, _, anchor = m.group(1).partition("#")
            file = (path.parent / target).resolve() if target else path
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
                found.append(m.group(1))
    return found


def test_every_reference_in_docs_conf_and_docstrings_resolves():
    broken = {}
    for path, text in _texts():
        if found := dangling(path, text):
            broken.setdefault(str(path.relative_to(ROOT)), []).extend(found)
    assert broken == {}


def test_the_reference_check_sees_what_moved():
    doc = ROOT / "docs" / "cli.md"
    text = (
        "`sess.harness.config.LoraConfig`, `sess.loops.grpo.train`, `tests/loops/test_loops.py`, "
        "[runs](cli.md#runs), and the moved `sess.loops.config`, `sess.rl.rollouts.no_such_function`, "
        "`sess.harness.config.LoraConfig.no_such_field`, `tests/test_tinker_sdk.py`, [gone](nowhere.md), "
        "[no heading](cli.md#no-such-heading)"
    )
    assert dangling(doc, text) == [
        "sess.loops.config",
        "sess.rl.rollouts.no_such_function",
        "sess.harness.config.LoraConfig.no_such_field",
        "tests/test_tinker_sdk.py",
        "nowhere.md",
        "cli.md#no-such-heading",
    ]
