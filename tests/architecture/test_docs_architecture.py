"""docs/architecture.md kept true to the code, and every doc reachable from the README.

- every file the page cites (`rl/step.py`, `tests/test_cli.py::test_x`, `posttrain.agents.builtin_envs:calculator`)
  exists, and every `file.py: name` names something defined in that file (`Class.method` included);
- every module under posttrain/ is named in its package's row of the package table;
- the layer map (the fenced block under "Layers (lowest first)") is what the imports do: no import points up;
- every file under docs/ is linked from README.md or from a page that README.md links, transitively.
"""

import ast
import re
from pathlib import Path

import pytest

from tests.architecture.test_layers import edges, modules, package

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "posttrain"
DOCS = REPO / "docs"
DOC = DOCS / "architecture.md"

# `path/to/file.py`, `file.py: name`, `file.py: Class.method`, `tests/x.py::test_name` inside one code span.
CITE = re.compile(r"`([\w./-]+\.py)(?:(::|:)\s*([A-Za-z_][\w.]*))?`?")
SPAN = re.compile(r"`([^`]+)`", re.S)
MODULE_CITE = re.compile(r"^(posttrain(?:\.\w+)+):(\w+)$")


def spans(text: str) -> list[str]:
    """The inline code spans of a markdown text, fenced blocks left out (they hold diagrams and commands)."""
    unfenced = re.sub(r"```.*?```", "", text, flags=re.S)
    return [" ".join(s.split()) for s in SPAN.findall(unfenced)]


def defined_names(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module (functions, classes, assignments, imports) -> the names defined in each class
    (methods, class attributes); other names map to an empty set."""
    tree = ast.parse(path.read_text())
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            members = set()
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(child.name)
                elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
                    members.add(child.target.id)
                elif isinstance(child, ast.Assign):
                    members.update(t.id for t in child.targets if isinstance(t, ast.Name))
            out[node.name] = members
        elif isinstance(node, ast.Assign):
            out.update({t.id: set() for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = set()
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: set() for a in node.names})
    return out


def resolve(cited: str, bases: list[Path]) -> Path | None:
    for base in bases:
        if (base / cited).is_file():
            return base / cited
    return None


def name_problem(path: Path, name: str) -> str | None:
    """Why `name` (`f`, `Class`, `Class.method`) is not defined in `path`, or None when it is."""
    names = defined_names(path)
    head, _, member = name.partition(".")
    if head not in names:
        return f"{path.relative_to(REPO)} defines no {head!r}"
    if member and member.split(".")[0] not in names[head]:
        return f"{path.relative_to(REPO)}: {head} has no {member!r}"
    return None


def check_cites(text: str, bases: list[Path]) -> list[str]:
    """Problems with the files and names cited in `text`'s code spans, each file looked up under `bases`."""
    problems = []
    for span in spans(text):
        module_cite = MODULE_CITE.match(span)
        if module_cite:
            mod, name = module_cite.groups()
            path = resolve(mod.replace(".", "/") + ".py", [REPO]) or resolve(
                mod.replace(".", "/") + "/__init__.py", [REPO]
            )
            problem = f"`{span}`: no module {mod}" if path is None else name_problem(path, name)
            problems += [problem] if problem else []
            continue
        for cited, _sep, name in CITE.findall(f"`{span}`"):
            path = resolve(cited, bases)
            if path is None:
                problems.append(
                    f"`{span}`: no file {cited} under {[str(b.relative_to(REPO)) for b in bases]}"
                )
            elif name and (problem := name_problem(path, name.rstrip("."))):
                problems.append(f"`{span}`: {problem}")
    return problems


def table_rows() -> dict[str, str]:
    """The package table: first column (`config/`, `rl/collect/`, `cli.py`) -> the rest of the row."""
    section = DOC.read_text().split("## What each package owns")[1].split("\n## ")[0]
    return {
        line.split("`")[1]: line.split("|", 2)[2] for line in section.splitlines() if line.startswith("| `")
    }


def row_base(first_column: str) -> Path:
    return PKG / first_column if first_column.endswith("/") else PKG


def test_every_file_and_name_the_page_cites_exists():
    text = DOC.read_text()
    section = text.split("## What each package owns")[1].split("\n## ")[0]
    problems = []
    for first, row in table_rows().items():  # a row's files are named from its package, or from posttrain/
        problems += check_cites(row, [row_base(first), PKG, REPO])
    problems += check_cites(text.replace(section, ""), [PKG, REPO])
    assert not problems, "docs/architecture.md cites what does not exist:\n" + "\n".join(problems)


def test_the_citation_check_finds_a_missing_file_and_a_missing_name():
    """The check above is not vacuous: a wrong file, a wrong name and a wrong method are each reported."""
    text = "`rl/step.py: train_step` `rl/nope.py` `rl/step.py: no_such` `train/loop.py: TrainLoop.nope`"
    problems = check_cites(text, [PKG, REPO])
    assert len(problems) == 3, problems
    assert "no file rl/nope.py" in problems[0]
    assert "defines no 'no_such'" in problems[1] and "TrainLoop has no 'nope'" in problems[2]
    assert check_cites(
        "`posttrain.agents.builtin_envs:calculator` `posttrain.agents.builtin_envs:nope`", [PKG]
    )[0].endswith("defines no 'nope'")


def test_every_module_is_named_in_its_package_row():
    rows = table_rows()
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if path.name == "__init__.py" and rel.count("/") <= 1 and rel != "__init__.py":
            continue  # a package's own __init__ is the package's row
        owner = max((f for f in rows if rel.startswith(f) or rel == f), key=len, default=None)
        if owner is None:  # __init__.py, __main__.py: the command line's row
            owner = "cli.py"
        if owner == rel:
            continue
        inside = rel[len(owner) :] if owner.endswith("/") else rel
        if path.name == "__init__.py":
            inside = inside.removesuffix("__init__.py")
            names = {f"`{inside}", f"`{rel.removesuffix('__init__.py')}"}
        else:
            names = {f"`{inside}`", f"`{rel}`", f"`{inside}:", f"`{rel}:", f"`{path.name}`"}
        if not any(n in rows[owner] for n in names):
            missing.append(f"{rel} (in the row of `{owner}`)")
    assert not missing, "docs/architecture.md's package table does not name:\n" + "\n".join(missing)


def doc_layers() -> list[set[str]]:
    """The layer map, lowest first: each unindented line of the fenced block names its packages, comma-separated,
    before a run of spaces. `cli` stands for the top-level modules (cli.py, __main__.py, __init__.py)."""
    block = DOC.read_text().split("## Layers (lowest first)")[1].split("```")[1]
    rows = [line.split("  ")[0].strip() for line in block.splitlines() if line.strip() and line[0] != " "]
    layers = [{name.strip() for name in row.split(",")} for row in rows]
    return [layer | {"__main__", "__init__"} if "cli" in layer else layer for layer in layers]


def test_the_layer_map_names_every_package_once():
    layers = doc_layers()
    named = [pkg for layer in layers for pkg in layer]
    assert len(named) == len(set(named)), named
    assert {package(m) for m in modules()} == set(named)


def test_no_import_points_up_the_documented_layer_map():
    layer_of = {pkg: i for i, layer in enumerate(doc_layers()) for pkg in layer}
    upward = [
        f"{src} ({package(src)}, layer {layer_of[package(src)]}) imports {dst} ({package(dst)}, "
        f"layer {layer_of[package(dst)]}) at line {line}"
        for src, dst, _, line in edges()
        if layer_of[package(dst)] > layer_of[package(src)]
    ]
    assert not upward, "imports against docs/architecture.md's layer map:\n" + "\n".join(upward)


def test_only_the_command_line_imports_planning():
    """The page says so: nothing imports planning but the command line."""
    wrong = [f"{s} imports {d}" for s, d, _, _ in edges() if package(d) == "planning" and package(s) != "cli"]
    wrong = [w for w in wrong if not w.startswith("posttrain.planning")]
    assert not wrong, wrong


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)|(?<![\w/.])(docs/[\w./-]+\.md)")


def links(page: Path) -> set[Path]:
    """Markdown files a page links: `[text](relative.md#anchor)` links and plain `docs/x.md` mentions."""
    out = set()
    for target, mention in LINK.findall(page.read_text()):
        if target and not re.match(r"^[a-z]+:", target):
            path = (page.parent / target).resolve()
        elif mention:
            path = (REPO / mention).resolve()
        else:
            continue
        if path.suffix == ".md" and path.is_file():
            out.add(path)
    return out


def reachable_from_readme() -> set[Path]:
    seen, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        todo += [p for p in links(page) if p not in seen]
    return seen


def test_every_doc_is_reachable_from_the_readme():
    reachable = reachable_from_readme()
    unreachable = sorted(
        p.relative_to(REPO).as_posix() for p in DOCS.rglob("*.md") if p.resolve() not in reachable
    )
    assert not unreachable, f"not linked from README.md nor from a page it links: {unreachable}"


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_relative_links_of_each_doc_resolve(page):
    broken = []
    for target, _ in LINK.findall(page.read_text()):
        if target and not re.match(r"^[a-z]+:", target) and not (page.parent / target).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)} links files that do not exist: {broken}"
