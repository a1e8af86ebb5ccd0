"""Size limits of docs/architecture.md, enforced: no module under posttrain/ over MAX_FILE_LINES lines and no
function (or method, or nested function) over MAX_FUNCTION_LINES lines, counted from ``def`` to the end of its
body as ast gives them (decorators left out, docstring and comments in).

Over the limit means split it along its seams. A function that is clearer whole goes in ALLOWED with the reason;
an entry that no longer names a long function fails too, so the list cannot go stale.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "posttrain"

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60

# "path/relative/to/posttrain.py:Qualified.name" -> why it stays longer than the limit.
ALLOWED: dict[str, str] = {}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function in ``tree``, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    files, functions = {}, {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        files[rel] = len(text.splitlines())
        for name, node in _functions(ast.parse(text, filename=str(path))):
            functions[f"{rel}:{name}"] = node.end_lineno - node.lineno + 1
    return files, functions


def test_no_module_is_over_the_file_limit():
    files, _ = _sizes()
    long = [f"posttrain/{rel}: {n} lines" for rel, n in files.items() if n > MAX_FILE_LINES]
    message = f"modules over {MAX_FILE_LINES} lines (split them into cohesive modules):\n"
    assert not long, message + "\n".join(long)


def test_no_function_is_over_the_function_limit():
    _, functions = _sizes()
    long = [
        f"posttrain/{name}: {n} lines"
        for name, n in functions.items()
        if n > MAX_FUNCTION_LINES and name not in ALLOWED
    ]
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them along their seams, or add them to ALLOWED "
        "with the reason they read better whole):\n" + "\n".join(long)
    )


def test_every_allowed_function_exists_and_is_still_long():
    _, functions = _sizes()
    stale = [
        f"{name}: " + (f"{functions[name]} lines" if name in functions else "no such function")
        for name in ALLOWED
        if functions.get(name, 0) <= MAX_FUNCTION_LINES
    ]
    assert not stale, "ALLOWED entries to remove (the function is gone or short now):\n" + "\n".join(stale)


def test_the_counter_sees_methods_and_nested_functions():
    tree = ast.parse(
        "class A:\n    def f(self):\n        def g():\n            pass\n\n\ndef h():\n    pass\n"
    )
    assert [name for name, _ in _functions(tree)] == ["A.f", "A.f.g", "h"]
