"""The dependency rules of docs/DESIGN.md, checked on the source: who may import whom.

Every import statement of every module is read with ``ast`` (function-level imports too), so a
lazy import inside a function cannot slip past the rule either.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _violations(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in _modules(package):
        for name in sorted(_imports(path)):
            hit = any(name == f or name.startswith(f + ".") for f in forbidden)
            ok = any(name == a or name.startswith(a + ".") for a in allowed)
            if hit and not ok:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def test_executor_never_imports_autopipe() -> None:
    assert _modules("executor")
    assert _violations("executor", ("autopipe",)) == []


def test_the_local_runtime_never_imports_the_rank_runtime() -> None:
    assert _modules("executor/local")
    assert _violations("executor/local", ("executor.ranks",)) == []


def test_the_rank_runtime_never_imports_the_local_runtime() -> None:
    assert _modules("executor/ranks")
    assert _violations("executor/ranks", ("executor.local",)) == []


def test_what_the_runtimes_share_imports_neither_runtime() -> None:
    """The modules directly in executor/ (bar its lazy ``__init__``) and executor/checkpoint/
    are the two runtimes' common ground: they import neither of them."""
    shared = [p for p in (ROOT / "executor").glob("*.py") if p.name != "__init__.py"]
    assert len(shared) > 5
    bad = [f"{path.relative_to(ROOT)} imports {name}"
           for path in [*shared, *_modules("executor/checkpoint")] for name in sorted(_imports(path))
           if name.split(".")[:2] in (["executor", "local"], ["executor", "ranks"])]
    assert bad == []


APPLICATION = ("autopipe.app", "autopipe.assemble")
# the runtime's modules as a library: what every package may use of it
RUNTIME_SHARED = ("executor.spec", "executor.decision", "executor._torch_compat")
# the runtime's torch-free rules and values, which the planner shares ([Note: a plan's decision])
TORCH_FREE = ("executor.spec", "executor.decision")


@pytest.mark.parametrize("package", ["autopipe/core", "autopipe/solvers"])
def test_the_planner_imports_no_torch_and_nothing_downstream(package: str) -> None:
    downstream = ("torch", "autopipe.frontend", "autopipe.plot", "autopipe.examples", "executor",
                  *APPLICATION)
    assert _violations(package, downstream, allowed=TORCH_FREE) == []


def test_solvers_are_not_imported_by_the_core() -> None:
    assert _violations("autopipe/core", ("autopipe.solvers",)) == []


def test_the_frontend_does_not_reach_the_application_or_the_solvers() -> None:
    assert _violations("autopipe/frontend", ("autopipe.plot", "autopipe.solvers", "autopipe.examples",
                                             *APPLICATION)) == []


def test_tracing_knows_no_measurement_no_stages_and_no_runtime() -> None:
    """A LayerGraph is made from the model alone: tracing imports neither of the jobs after it,
    nor the runtime beyond its shared rules."""
    assert _violations("autopipe/frontend/tracing", ("autopipe.frontend.profiling",
                                                     "autopipe.frontend.building", "executor"),
                       allowed=RUNTIME_SHARED) == []


def test_building_stages_needs_no_measurement_and_no_runtime() -> None:
    """Stage modules are cut from the graph by the plan: no profiler, no runtime beyond the
    shared rules (so the runtime can run stages built on a machine that never profiled)."""
    assert _violations("autopipe/frontend/building", ("autopipe.frontend.profiling", "executor"),
                       allowed=RUNTIME_SHARED) == []


def test_profiling_measures_the_runtime_it_predicts() -> None:
    """Profiling times the runtime's own machinery ([Note: measured overheads], [Note: measured
    transfer]): exactly these runtime modules, and no other (executor.precision: the stages'
    own autocast, [Note: profiling under a precision]; executor.memory_meter: the loss's bytes,
    [Note: the loss's memory])."""
    measured = ("executor.local.gpipe", "executor.ranks.distributed", "executor.ranks.rank_cores",
                "executor.host_allocator", "executor.precision", "executor.memory_meter")
    assert _violations("autopipe/frontend/profiling", ("executor",),
                       allowed=(*RUNTIME_SHARED, *measured)) == []


def test_profiling_by_job() -> None:
    """The per-layer harness knows nothing of the whole-model corrections or the experiments
    that start processes; those two do not know each other."""
    jobs = "autopipe/frontend/profiling"
    harness, corrections, spawned = (f"autopipe.frontend.profiling.{job}"
                                     for job in ("harness", "corrections", "spawned"))
    assert all(_modules(f"{jobs}/{job}") for job in ("harness", "corrections", "spawned"))
    assert _violations(f"{jobs}/harness", (corrections, spawned)) == []
    assert _violations(f"{jobs}/corrections", (spawned,)) == []
    assert _violations(f"{jobs}/spawned", (corrections,)) == []
    assert _violations(f"{jobs}/estimated", (spawned,)) == []  # an estimate starts no process


def test_assembling_never_reaches_the_command_line() -> None:
    """autopipe/assemble/ is the library's entry points; the command line is built on them."""
    assert _modules("autopipe/assemble")
    assert _violations("autopipe/assemble", ("autopipe.app",)) == []


def test_plots_read_plans_and_profiles_only() -> None:
    assert _violations("autopipe/plot", ("torch", "autopipe.frontend", "autopipe.app",
                                         "autopipe.assemble")) == []


def test_executor_spec_is_torch_free() -> None:
    assert _imports(ROOT / "executor" / "spec.py") <= {"__future__", "__future__.annotations",
                                                      "dataclasses", "dataclasses.dataclass",
                                                      "typing", "typing.Any", "warnings"}


def test_a_decision_is_torch_free() -> None:
    """executor/decision.py: the standard library and executor.spec, nothing else."""
    names = _imports(ROOT / "executor" / "decision.py")
    assert {n.split(".")[0] for n in names} <= {"__future__", "collections", "dataclasses", "typing",
                                               "executor"}
    assert {n for n in names if n.startswith("executor")} <= {"executor.spec"} | {
        f"executor.spec.{x}" for x in dir(__import__("executor.spec", fromlist=["*"]))}


def test_private_torch_names_come_only_from_the_compat_package() -> None:
    compat = ROOT / "executor" / "_torch_compat"
    assert (compat / "__init__.py").is_file()
    bad = []
    for path in [*_modules("autopipe"), *_modules("executor")]:
        if compat in path.parents:
            continue
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "torch" and any(p.startswith("_") for p in parts[1:]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


def _loaded_imports(path: Path) -> set[str]:
    """What importing ``path`` imports at once: its module-level imports (in ``if`` / ``try`` /
    ``with`` blocks too), not those in functions nor under ``if TYPE_CHECKING:``."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body.extend(node.orelse)
        elif isinstance(node, ast.If | ast.Try):
            body.extend([*node.body, *node.orelse, *getattr(node, "finalbody", [])])
        elif isinstance(node, ast.With):
            body.extend(node.body)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _source(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def test_a_rank_loads_no_table_solver_or_plot_library() -> None:
    """[Note: lazy package] ``autopipe run``'s ranks (rank_main) build and run a pipeline from a
    plan: importing them loads no pandas (the profile table and the profiler), PuLP (the ILP) or
    matplotlib, each ~0.3-1 s of every rank's start; those are imported where they are used."""
    seen: set[str] = set()
    todo = ["autopipe.app.rank_main"]
    external: set[str] = set()
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # a module imports its packages first
            name = ".".join(parts[:i])
            path = _source(name)
            if name in seen or (path is None and parts[0] in ("autopipe", "executor", "tests")):
                continue
            seen.add(name)
            if path is None:
                external.add(parts[0])
                continue
            todo.extend(_loaded_imports(path))
    assert "autopipe.assemble.ranks" in seen and "torch" in external
    assert not external & {"pandas", "pulp", "matplotlib"}, sorted(external)


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80  # of code, after its docstring


@pytest.mark.parametrize("package", ["autopipe", "executor"])
def test_no_module_is_over_400_lines(package: str) -> None:
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _modules(package)
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not long, f"split these by job (docs/DESIGN.md): {long}"


def test_no_function_that_assembles_a_pipeline_is_over_80_lines_of_code() -> None:
    long = []
    for path in _modules("autopipe/assemble"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = node.body[0]
                documented = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                start = node.body[1].lineno if documented and len(node.body) > 1 else first.lineno
                if (n := (node.end_lineno or start) - start + 1) > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"delegate to helpers, as torchtitan's variants do: {long}"
