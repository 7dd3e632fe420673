"""The package's shape: every module in a subpackage by concern, the run path free of
identity caches and tuple tricks, and no failure kept in a module-global list."""

import ast
import importlib
import pathlib

import jaxmon

PACKAGE = pathlib.Path(jaxmon.__file__).parent
#: The top-level modules: the package, `python -m jaxmon`, and the public faces.
TOP_LEVEL = {"__init__.py", "__main__.py", "distributed.py", "models.py"}
#: The run path: what every run goes through.
RUN_PATH = ("_run", "_metrics", "_base", "_ops", "hooks")


def _sources(*folders: str) -> dict[str, ast.Module]:
    paths = [path for folder in folders for path in sorted((PACKAGE / folder).rglob("*.py"))] if folders else sorted(
        PACKAGE.rglob("*.py"))
    return {str(path.relative_to(PACKAGE)): ast.parse(path.read_text()) for path in paths}


def test_every_module_but_the_public_faces_is_in_a_subpackage():
    top = {path.name for path in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL, sorted(top - TOP_LEVEL)
    for folder in (path for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"):
        assert (folder / "__init__.py").is_file(), folder  # a package, with a docstring that says what it holds
        assert ast.get_docstring(ast.parse((folder / "__init__.py").read_text())), folder


def test_no_two_modules_share_a_name_unless_one_is_the_public_face():
    names: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            names.setdefault(path.stem.lstrip("_"), []).append(str(path.relative_to(PACKAGE)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not shared, shared


def test_the_run_path_keys_nothing_by_identity_but_a_hook():
    """`id()` names a hook (the session holds its hooks for its whole life: per-hook
    tables), never a tuple, a plan or a call that another module must hand back."""
    found = []
    for name, tree in _sources(*RUN_PATH).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "id":
                argument = ast.unparse(node.args[0])
                if argument not in ("hook", "slot.hook", "spec"):  # spec: only a sort's tie-breaker (FetchPlan.key)
                    found.append(f"{name}:{node.lineno}: id({argument})")
    assert not found, found
    fetches = ast.unparse(_sources("_base")["_base/fetches.py"])
    assert "key=lambda spec: (hash(spec), id(spec))" in fetches


def test_no_module_aliases_tuple_new():
    found = [f"{name}:{node.lineno}" for name, tree in _sources().items() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == "__new__" and ast.unparse(node.value) == "tuple"]
    assert not found, found


def test_no_module_keeps_failures_in_a_global_list():
    """A session's failures are its own (`_ops/failures.py`): no module-level list, set,
    dict or deque that holds them for every session in the process."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        for name, value in vars(module).items():
            failures = "failed" in name.lower() or "failures" in name.lower()
            if failures and (isinstance(value, (list, set, dict)) or type(value).__name__ == "deque"):
                raise AssertionError(f"{module.__name__}.{name} is a module-global {type(value).__name__}")


def test_the_public_names_for_type_checkers_are_the_ones_loaded():
    """`jaxmon/__init__.py` lists its names twice: as `if TYPE_CHECKING:` imports, which
    type checkers read, and as plain code, which `__getattr__` reads."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    imported = {alias.name: f"jaxmon.{alias.name}" if node.module == "jaxmon" else node.module
                for node in block.body for alias in node.names}
    assert imported == jaxmon._MODULE_OF


#: The floors, lowest first (docs/architecture.md, "Floors"): a module imports from its own
#: floor or a lower one. The top-level public modules are floors of their own.
FLOORS = ("_base", "models", "datasets", "_data", "_ops", "_writers", "_checkpoints", "_metrics", "_processes", "_run",
          "hooks", "_experiment", "_cli", "distributed", "__init__", "__main__")
#: The imports that point up, each with its reason in docs/architecture.md.
UPWARD = {
    ("jaxmon._run.training", "jaxmon.hooks"),
    ("jaxmon._run.training", "jaxmon.hooks._throughput"),
    ("jaxmon._experiment.sections", "jaxmon"),
    ("jaxmon._processes.launch", "jaxmon.distributed"),
}


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS.index(parts[1] if len(parts) > 1 else "__init__")


def _imports() -> list[tuple[str, str, int]]:
    """(module, the jaxmon module it imports, line) for every import in the package, those
    inside functions too; `from jaxmon import x` imports `jaxmon.x`."""
    found = []
    for name, tree in _sources().items():
        parts = pathlib.PurePath(name).with_suffix("").parts
        module = ".".join(("jaxmon", *(parts[:-1] if parts[-1] == "__init__" else parts)))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("jaxmon"):
                is_package = node.module == "jaxmon"
                targets = [f"jaxmon.{alias.name}" for alias in node.names] if is_package else [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names if alias.name.startswith("jaxmon")]
            found += [(module, target, node.lineno) for target in targets]
    return found


def _unnamed_upward(imports: list[tuple[str, str, int]]) -> list[str]:
    """What the floor test names: each import that points up and is not in `UPWARD`."""
    return sorted(f"{module}:{line} imports {target}, a higher floor" for module, target, line in imports
                  if _floor(target) > _floor(module) and (module, target) not in UPWARD)


def test_every_import_points_down_the_floors_but_the_named_few():
    imports = _imports()
    assert len(imports) > 300 and not _unnamed_upward(imports), _unnamed_upward(imports)
    upward = {(module, target) for module, target, _ in imports if _floor(target) > _floor(module)}
    assert upward == UPWARD, sorted(UPWARD - upward)  # one no longer there: take it off the list
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for module, target in UPWARD:
        shown = [f"`{name.removeprefix('jaxmon.').replace('.', '/')}" for name in (module, target)]
        assert all(words in page for words in shown), (module, target)


def test_the_floor_test_names_a_new_import_that_points_up():
    found = _unnamed_upward([("jaxmon._ops.report_thread", "jaxmon._run.session", 7),
                             ("jaxmon._run.session", "jaxmon._ops.report_thread", 9)])
    assert found == ["jaxmon._ops.report_thread:7 imports jaxmon._run.session, a higher floor"]
