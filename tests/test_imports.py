"""The package's import graph: no cycle (function-level imports included), the library free of UI and tests."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "gdnviz"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Module -> the gdnviz modules it imports anywhere in its file (top level or inside functions)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            # a package's own __init__ importing its submodules is not a cycle of modules
            if m.startswith(d + ".") or d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_library_imports_no_ui_and_no_tests():
    """The library is UI-free (Streamlit only in gdnviz.ui) and never imports the tests' or benchmarks' tools."""
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        tree = ast.parse(text)
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(n.split(".")[0] in ("tests", "bench") for n in names), path
        if "ui" not in path.relative_to(PKG).parts:
            assert "streamlit" not in {n.split(".")[0] for n in names}, path


def test_analysis_is_pure():
    """gdnviz.analysis holds the definitions as functions over arrays: it imports no GPU module of gdnviz."""
    for name, deps in _graph().items():
        if name.startswith("gdnviz.analysis"):
            assert not {d for d in deps if d.startswith("gdnviz.gpu") or d == "gdnviz.statistics"}, (name, deps)


def test_dask_is_imported_only_for_a_cluster():
    """Dask stays optional: the library, the CLI, the jobs and the worker import nothing of it until a cluster runs."""
    import subprocess
    import sys

    code = ("import sys, gdnviz.cli, gdnviz.jobs, gdnviz.worker, gdnviz.probes.sweep, gdnviz.probes.scan, "
            "gdnviz.probes.budget, gdnviz.probes.loss_sweep, gdnviz.cluster; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed', 'dask_cuda')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PKG.parent)
