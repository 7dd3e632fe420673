"""Every jaxmon module imports on its own, and no two modules import each other in a circle."""

import ast
import importlib
import json
import pathlib
import subprocess
import sys

import pytest

import jaxmon

PACKAGE = pathlib.Path(jaxmon.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":  # runs the command line when imported
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _packages_of(module: str) -> set[str]:
    """The jaxmon packages below the top one that importing `module` loads first."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in MODULES}


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The jaxmon modules `name` imports, at module level, inside functions and for
    type checkers (`if TYPE_CHECKING:`) alike: a circle a reader follows is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def target(module: str) -> str | None:
        while module and module not in MODULES:
            module = module.rpartition(".")[0]
        return module or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.update(_packages_of(alias.name) | {t for t in [target(alias.name)] if t})
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                t = full if full in MODULES else target(base)
                if t:
                    found.add(t)
            found.update(_packages_of(base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {t for t in found if t != name and not name.startswith(t + ".")}  # a parent package loads first


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in `graph`, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_no_jaxmon_module_imports_another_in_a_circle():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert len(graph) > 20 and graph["jaxmon._run.session"], graph  # the graph was read
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


CORE = ("jaxmon._run.session", "jaxmon._run.hook_runner", "jaxmon._run.batches", "jaxmon._run.dispatch",
        "jaxmon._run.state_life", "jaxmon._run.stopping", "jaxmon._processes.agree", "jaxmon._base.hook",
        "jaxmon._run.compiled_step", "jaxmon._base.fetches")


def test_the_core_knows_no_particular_hook():
    """The session finds what it needs of hooks through the Hook protocol
    (`next_trigger`, the `Saver` protocol), never by importing a hook."""
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    seen, todo = set(), list(CORE)
    while todo:  # everything the core loads, directly or not
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    assert not {name for name in seen if name.startswith("jaxmon.hooks")}, sorted(seen)


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_every_module_imports():
    for name in MODULES:
        assert importlib.import_module(name).__name__ == name


def test_modules_stay_small_and_the_session_class_fits_on_a_few_screens():
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert max(sizes.values()) <= 500, {name: n for name, n in sizes.items() if n > 500}
    tree = ast.parse(MODULES["jaxmon._run.session"].read_text())
    [session] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "MonitoredSession"]
    assert session.end_lineno - session.lineno + 1 <= 325


def test_no_module_reaches_into_another_objects_private_members():
    offenders = [f"{name}:{i}" for name, path in MODULES.items()
                 for i, line in enumerate(path.read_text().splitlines(), 1) if "noqa: SLF001" in line]
    assert not offenders, offenders


def test_the_hook_protocol_fits_on_a_screen():
    """Events, `get_state`/`set_state`, one scheduling question, the metrics declaration
    and `on_error`: at most 12 public members."""
    members = sorted(name for cls in jaxmon.Hook.__mro__[:-1] for name in vars(cls) if not name.startswith("_"))
    assert len(members) <= 12, members
    assert {"begin", "after_create_session", "before_run", "after_run", "end", "next_trigger"} <= set(members)


LOADS = """
import json, os, sys
import jaxmon
from jaxmon._cli import main as _cli
before = sorted(m for m in ("jax", "flax", "optax", "orbax") if m in sys.modules)
try:
    code = _cli.main(sys.argv[1:])
except SystemExit as exit:  # --help
    code = exit.code
sys.stdout.flush()
os.write(1, json.dumps({"before": before, "code": code,
                        "after": sorted(m for m in ("jax", "flax", "optax", "orbax") if m in sys.modules)}).encode())
"""


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0),
    (["train", "--config", "configs/default.py", "--workdir", "{tmp}/new", "--config.sesion.max_to_keep=2"], 2),
    (["train", "--config", "{tmp}/missing.py", "--workdir", "{tmp}/new"], 2),
    (["inspect", "{tmp}/run"], 0),
], ids=["help", "config-key", "config-file", "inspect"])
def test_the_command_answers_help_a_configs_error_and_inspect_without_loading_jax(argv, code, tmp_path):
    """`import jaxmon` loads no JAX, and neither do `jaxmon --help`, a config's error nor
    `jaxmon inspect`: each answers in a fraction of a second, not after JAX has loaded."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    done = subprocess.run([sys.executable, "-c", LOADS, *argv], cwd=PACKAGE.parent, capture_output=True, text=True,
                          timeout=120)
    said, _, result = done.stdout.rpartition("\n")
    assert json.loads(result) == {"before": [], "code": code, "after": []}, (done.stdout[-2000:], done.stderr[-2000:])
    if argv[0] == "inspect":
        assert "loss  1  (step 2)" in said, said
