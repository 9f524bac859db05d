"""The notebooks run top to bottom on CPU and are committed without outputs, so they cannot rot.

Each notebook runs in a fresh ``python3`` kernel (nbclient) from the notebooks/ folder, as a
user opening it would; it reads the committed profiles in profiles/. A cell that ends by
drawing a figure must show it as an image.
"""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    drawing = [c for c in nb.cells if c.cell_type == "code"
               and c.source.strip().splitlines()[-1].startswith(DRAWS)]
    assert drawing, f"{path.name} draws no figure"
    for cell in drawing:
        kinds = [set(o.get("data", {})) for o in cell.outputs]
        assert any("image/png" in k for k in kinds), (
            f"{path.name}: cell {cell.source.splitlines()[-1]!r} showed no image, only {kinds}")
