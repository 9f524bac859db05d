"""The notebooks run top to bottom on CPU and are committed without outputs, so they cannot rot.

Each notebook runs in a fresh ``python3`` kernel (nbclient) from the notebooks/ folder, as a
user opening it would; it reads the committed profiles in profiles/. A cell that ends by
drawing a figure must show it as an image. The kernels are separate processes, so both
notebooks run at once (one event loop drives both clients) and each test checks its own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
DRAWS = ("plot_balance(", "plot_profile(", "plot_timeline(", "compare_plans(")


def test_the_notebooks_are_there() -> None:
    assert [p.name for p in PATHS] == ["01_quickstart.ipynb", "02_partitioners.ipynb"]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_notebook_is_committed_clean(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} is committed with outputs; clear them (Kernel > Restart & Clear)")


@pytest.fixture(scope="module")
def executed() -> dict[Path, Any]:
    """Every notebook executed, at the same time: its run notebook, or what its run raised."""
    notebooks = {path: nbformat.read(path, as_version=4) for path in PATHS}

    async def run_all() -> list[Any]:
        clients = [nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                           resources={"metadata": {"path": str(NOTEBOOKS)}})
                   for nb in notebooks.values()]
        # each raises CellExecutionError naming the failing cell
        return await asyncio.gather(*(c.async_execute() for c in clients), return_exceptions=True)

    results = asyncio.run(run_all())
    return {path: result if isinstance(result, BaseException) else nb
            for (path, nb), result in zip(notebooks.items(), results, strict=True)}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, executed: dict[Path, Any]) -> None:
    nb = executed[path]
    if isinstance(nb, BaseException):
        raise nb
    drawing = [c for c in nb.cells if c.cell_type == "code"
               and c.source.strip().splitlines()[-1].startswith(DRAWS)]
    assert drawing, f"{path.name} draws no figure"
    for cell in drawing:
        kinds = [set(o.get("data", {})) for o in cell.outputs]
        assert any("image/png" in k for k in kinds), (
            f"{path.name}: cell {cell.source.splitlines()[-1]!r} showed no image, only {kinds}")
