"""autopipe.plot: figure contents (bars, lines, titles, units, legends), bad inputs, the CLI."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from matplotlib import _pylab_helpers
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import nn

from autopipe.app.cli import build_parser, main
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate
from autopipe.errors import PlanError, PlotError, ProfileError
from autopipe.plot import (
    bubble_fraction,
    compare_plans,
    plot_balance,
    plot_profile,
    plot_timeline,
    save_figure,
)
from autopipe.plot.readme import readme_images
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import chain_profile, transformer_dag
from executor import GPipe, TimelineEvent

UNIT = re.compile(r"\((ms|%|B|KiB|MiB|GiB)\)")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def profile() -> Profile:
    return transformer_dag(2, seed=1)  # 18 layers with residual skips and a tied head


@pytest.fixture(scope="module")
def plan(profile: Profile) -> Plan:
    return partition(profile, stages=3, method="dp", chunks=4, memory_limit="2GiB")


def bars(ax: Axes, filled: bool = True) -> list[Rectangle]:
    """The boxes drawn by ax.bar / ax.barh (not shading or legend patches); ``filled=False``:
    the outlines (stragglers)."""
    return [p for c in ax.containers if isinstance(c, BarContainer) for p in c.patches
            if p.get_fill() == filled]


def legend_labels(ax: Axes) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None, f"axes {ax.get_title()!r} has no legend"
    return [t.get_text() for t in legend.get_texts()]


def assert_labelled(fig: Figure) -> None:
    """Every panel has a title and a y label with units; the figure has a title."""
    assert fig.get_suptitle()
    for ax in fig.axes:
        assert ax.get_title() or ax.get_title(loc="left"), "panel without a title"
        assert UNIT.search(ax.get_ylabel()) or ax.get_ylabel() == "pipeline stage", ax.get_ylabel()


# --- plot_balance --------------------------------------------------------------------------


def test_balance_bars_stack_to_the_stage_times(plan: Plan) -> None:
    fig = plot_balance(plan)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    ax_t, ax_m = fig.axes
    k = plan.num_stages
    assert len(bars(ax_t)) == 4 * k and len(bars(ax_m)) == 2 * k
    tops = [max(b.get_y() + b.get_height() for b in bars(ax_t) if round(b.get_x() + b.get_width() / 2) == s)
            for s in range(k)]
    assert tops == pytest.approx(plan.stage_times)
    bound = [line for line in ax_t.get_lines() if line.get_label().startswith("lower bound")]
    assert len(bound) == 1 and bound[0].get_ydata()[0] == pytest.approx(plan.lower_bound)
    assert legend_labels(ax_t)[-4:] == ["forward", "backward", "recompute", "transfer"]
    assert "device memory limit" in legend_labels(ax_m)
    assert "ms" in ax_t.get_ylabel() and "GiB" in ax_m.get_ylabel()  # the 2 GiB limit sets the unit
    assert "stage" in ax_t.get_xlabel()
    assert_labelled(fig)
    assert plan.method in fig.get_suptitle()


def test_balance_without_a_memory_limit_draws_no_limit(profile: Profile) -> None:
    fig = plot_balance(partition(profile, stages=2, method="uniform"))
    assert "device memory limit" not in legend_labels(fig.axes[1])
    assert not fig.axes[1].collections


def test_balance_needs_a_plan(profile: Profile) -> None:
    with pytest.raises(PlotError, match="plot_balance needs an autopipe.Plan, got Profile"):
        plot_balance(profile)  # type: ignore[arg-type]


# --- plot_profile --------------------------------------------------------------------------


def test_profile_bars_and_cuts(profile: Profile, plan: Plan) -> None:
    fig = plot_profile(profile, plan)
    ax_t, ax_m = fig.axes
    n = len(profile)
    assert len(bars(ax_t)) == 2 * n and len(bars(ax_m)) == 2 * n
    cuts = [line for line in ax_t.get_lines() if line.get_linestyle() == "--"]
    first = [sum(len(s) for s in plan.stages[:i]) for i in range(1, plan.num_stages)]
    assert sorted(line.get_xdata()[0] for line in cuts) == [i - 0.5 for i in first]
    assert [t.get_text() for t in ax_t.texts] == [f"stage {s}" for s in range(plan.num_stages)]
    assert legend_labels(ax_t) == ["stage cut", "forward", "backward"]
    # parameters are held once, activations per micro-batch: the legend says which, not the axis
    assert legend_labels(ax_m) == ["stage cut", "parameters (one copy)",
                                   "saved for backward (per micro-batch)"]
    assert ax_m.get_ylabel() == "memory (MiB)" and "per micro-batch" in ax_t.get_ylabel()
    assert ax_m.get_xlabel() == "layer (topological order)"
    assert [t.get_text() for t in ax_m.get_xticklabels()] == profile.layers
    assert_labelled(fig)


def _extents(fig: Figure) -> Any:
    """Draw ``fig`` with the Agg canvas; returns its renderer for window extents."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


@pytest.fixture(scope="module")
def profile_700() -> Profile:
    return transformer_dag(87)  # 698 layers


@pytest.mark.slow
@pytest.mark.parametrize("stages", [8, 40])
def test_profile_stage_names_stay_clear_of_the_legend_at_700_layers(profile_700: Profile,
                                                                     stages: int) -> None:
    plan = partition(profile_700, stages=stages, method="dp", chunks=4)
    fig = plot_profile(profile_700, plan)
    ax_t = fig.axes[0]
    renderer = _extents(fig)
    legend = ax_t.get_legend().get_window_extent(renderer)
    frame = ax_t.get_window_extent(renderer)
    boxes = [t.get_window_extent(renderer) for t in ax_t.texts]
    assert len(boxes) >= min(stages, 8)  # narrow stages may be numbered or only shaded
    if stages == 8:
        assert [t.get_text() for t in ax_t.texts] == [f"stage {s}" for s in range(8)]
    for box in boxes:
        assert not box.overlaps(legend)
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and box.y1 <= frame.y1
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b)


def test_many_layers_are_drawn_as_the_same_boxes_in_one_artist_each(profile_700: Profile) -> None:
    # beyond 200 layers each series is one filled outline (matplotlib takes ~1.5 ms a bar): its
    # boxes are where bars would be, of the profile's heights, with empty gaps between them
    from matplotlib.patches import StepPatch

    fig = plot_profile(profile_700)
    ax_t, ax_m = fig.axes
    assert not bars(ax_t) and not bars(ax_m)
    df, n = profile_700.df, len(profile_700)
    fwd, bwd = df["fwd_ms"].to_numpy(float), df["bwd_ms"].to_numpy(float)
    drawn = [p for p in ax_t.patches if isinstance(p, StepPatch)]
    assert [p.get_label() for p in drawn] == ["forward", "backward"]
    for patch, (low, high) in zip(drawn, [(0.0, fwd), (fwd, fwd + bwd)], strict=True):
        values, edges, baseline = patch.get_data()
        assert len(edges) == 2 * n and edges[0] == pytest.approx(-0.4) and edges[1] == pytest.approx(0.4)
        assert edges[2 * n - 1] == pytest.approx(n - 1 + 0.4)
        assert values[0::2] == pytest.approx(high) and baseline[0::2] == pytest.approx(np.broadcast_to(low, n))
        assert values[1::2] == pytest.approx(baseline[1::2])  # the gaps: nothing filled
    values, edges, _ = next(p for p in ax_m.patches if isinstance(p, StepPatch)).get_data()
    unit = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[ax_m.get_ylabel()[8:-1]]
    assert values[0::2] * unit == pytest.approx(df["param_bytes"].to_numpy(float))
    assert edges[0] == pytest.approx(-0.4) and edges[1] == pytest.approx(0.0)


def test_profile_without_a_plan_has_no_cuts(profile: Profile) -> None:
    fig = plot_profile(profile)
    assert not fig.axes[0].get_lines() and not fig.axes[0].texts
    assert "stages" not in fig.get_suptitle()


def test_profile_refuses_a_plan_for_another_model(plan: Plan) -> None:
    other = chain_profile([1.0] * 5)
    with pytest.raises(PlanError, match="not in the graph"):
        plot_profile(other, plan)
    with pytest.raises(PlotError, match="plot_profile needs an autopipe.Profile, got Plan"):
        plot_profile(plan)  # type: ignore[arg-type]


# --- plot_timeline -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured() -> list[TimelineEvent]:
    """A real trace of a 2-stage pipeline on CPU."""
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 32), nn.ReLU()), nn.Linear(32, 4)]
    pipe = GPipe(stages, ["cpu", "cpu"], chunks=4, recompute="except_last")
    with pipe.record_timeline() as events:
        pipe(torch.randn(16, 8)).sum().backward()
    assert events
    return events


def test_timeline_predicted_draws_one_box_per_event(plan: Plan) -> None:
    result = simulate(plan)
    fig = plot_timeline(result)  # a SimulationResult or its .timeline
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    assert len(bars(ax)) == len(result.timeline)
    # the figure's title names the one panel; the panel's own title gives only its numbers
    assert fig.get_suptitle() == "predicted pipeline timeline"
    assert "predicted" not in ax.get_title(loc="left")
    assert f"bubble {100 * result.bubble_fraction:.0f}%" in ax.get_title(loc="left")
    assert ax.get_xlabel() == "time since the iteration started (ms)"
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"stage {s}" for s in range(3)]
    assert {"forward", "backward", "recompute"} <= set(legend_labels(ax))
    assert_labelled(fig)


def test_timeline_predicted_over_measured(plan: Plan, measured: list[TimelineEvent]) -> None:
    predicted = simulate(plan).timeline
    fig = plot_timeline(predicted, measured)
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    assert top.get_title(loc="left").startswith("predicted:")
    assert bottom.get_title(loc="left").startswith("measured:")
    assert len(bars(bottom)) == len(measured)
    assert "predicted vs measured" in fig.get_suptitle()
    named = plot_timeline(measured, predicted, labels=["on CPU", "plan"], sharex=False)
    assert named.axes[0].get_title(loc="left").startswith("on CPU:")
    assert not named.axes[0].get_shared_x_axes().joined(*named.axes)


def test_timeline_title_names_a_single_panel_once(plan: Plan, tmp_path: Path) -> None:
    fig = plot_timeline(simulate(plan), labels=["predicted (gpipe)"])  # what `autopipe plot` draws
    texts = [fig.get_suptitle(), fig.axes[0].get_title(loc="left")]
    assert sum(t.count("predicted (gpipe)") for t in texts) == 1, texts
    titled = plot_timeline(simulate(plan), labels=["plan A"], title="my run")
    assert titled.axes[0].get_title(loc="left").startswith("plan A: ")  # named somewhere


def _transfers(length_ms: float) -> list[TimelineEvent]:
    """Two stages, two micro-batches; each forward of stage 0 sends for ``length_ms``."""
    events = []
    for m in range(2):
        events += [TimelineEvent(0, m, "forward", 2 * m, 2 * m + 2),
                   TimelineEvent(0, m, "transfer", 2 * m + 2, 2 * m + 2 + length_ms),
                   TimelineEvent(1, m, "forward", 2 * m + 2.5, 2 * m + 4.5)]
    return events


@pytest.mark.parametrize("length_ms,drawn,named", [
    (0.0, 0, False),  # zero-length (bandwidth=None): nothing drawn, no legend entry
    (1e-5, 2, False),  # far below a pixel of the 6.5 ms axis: drawn, not in the legend
    (0.5, 2, True),  # visible: drawn and named
])
def test_timeline_names_transfers_only_when_they_show(length_ms: float, drawn: int,
                                                      named: bool) -> None:
    ax = plot_timeline(_transfers(length_ms)).axes[0]
    thin = [b for b in bars(ax) if b.get_height() < 0.2]
    assert len(thin) == drawn and len(bars(ax)) == 4 + drawn
    assert ("transfer" in legend_labels(ax)) is named
    assert "forward" in legend_labels(ax)


def test_bubble_fraction_matches_the_simulator(plan: Plan) -> None:
    result = simulate(plan, schedule="1f1b")
    assert bubble_fraction(result.timeline) == pytest.approx(result.bubble_fraction)
    overlapping = [TimelineEvent(0, 0, "forward", 0, 2), TimelineEvent(0, 1, "transfer", 1, 2),
                   TimelineEvent(1, 0, "forward", 2, 4)]
    assert bubble_fraction(overlapping) == pytest.approx(1 - 4 / 8)  # overlap counted once


def test_timeline_outlines_stragglers() -> None:
    events = [TimelineEvent(0, i, "forward", 2.0 * i, 2.0 * i + (9.0 if i == 3 else 1.0))
              for i in range(4)]
    ax = plot_timeline(events).axes[0]
    assert "straggler (> 2x median)" in legend_labels(ax)
    assert len(bars(ax)) == 4 and len(bars(ax, filled=False)) == 1
    assert bars(ax, filled=False)[0].get_width() == 9.0
    ax = plot_timeline(events[:3]).axes[0]
    assert "straggler (> 2x median)" not in legend_labels(ax)


@pytest.mark.parametrize(("events", "match"), [
    ([], "is empty: nothing to draw"),
    ("forward", "must be a list of timeline events, got str"),
    ([object()], r"lacks field\(s\) \['stage', 'microbatch'"),
    ([TimelineEvent(0, 0, "idle", 0, 1)], "has phase 'idle'"),
    ([TimelineEvent(0, 0, "forward", 2, 1)], "need finite start_ms <= end_ms"),
    ([TimelineEvent(-1, 0, "forward", 0, 1)], "stages are numbered from 0"),
])
def test_timeline_bad_events(events: object, match: str) -> None:
    with pytest.raises(PlotError, match=match):
        plot_timeline(events)


def test_timeline_labels_must_match() -> None:
    with pytest.raises(PlotError, match="labels has 2 name"):
        plot_timeline([TimelineEvent(0, 0, "forward", 0, 1)], labels=["a", "b"])


# --- compare_plans -------------------------------------------------------------------------


def test_compare_plans(profile: Profile, plan: Plan) -> None:
    uniform = partition(profile, stages=3, method="uniform", chunks=4)
    fig = compare_plans([plan, uniform, plan])
    assert len(fig.axes) == 3
    for ax in fig.axes:
        assert len(bars(ax)) == 3
        assert [t.get_text() for t in ax.get_xticklabels()] == ["exact", "uniform", "exact #2"]
    ax_b, _, ax_m = fig.axes
    assert [b.get_height() for b in bars(ax_b)] == pytest.approx([plan.bottleneck, uniform.bottleneck, plan.bottleneck])
    assert ax_b.collections[0].get_offsets()[:, 1].tolist() == pytest.approx([plan.lower_bound, uniform.lower_bound, plan.lower_bound])
    assert legend_labels(ax_b) == ["lower bound"]
    assert legend_labels(ax_m) == ["device memory limit"]  # plan has a limit, uniform has none
    assert len(ax_m.collections[0].get_offsets()) == 2
    assert_labelled(fig)
    params = partition(profile, stages=3, method="params", chunks=4)
    named = compare_plans({"equal": uniform, "by parameters": params})
    assert [t.get_text() for t in named.axes[0].get_xticklabels()] == ["equal", "by parameters"]
    assert named.axes[2].get_legend() is None and "(no limit set)" in named.axes[2].get_title()


def test_compare_plans_bad_input(plan: Plan) -> None:
    with pytest.raises(PlotError, match="got no plans"):
        compare_plans([])
    with pytest.raises(PlotError, match=r"entry 'x'\) needs an autopipe.Plan, got int"):
        compare_plans({"ok": plan, "x": 3})  # type: ignore[dict-item]
    with pytest.raises(PlotError, match="needs a list or dict of Plans, got str"):
        compare_plans("dp")  # type: ignore[arg-type]


# --- files and the CLI ---------------------------------------------------------------------


def test_figures_leave_no_pyplot_state(plan: Plan, tmp_path: Path) -> None:
    before = _pylab_helpers.Gcf.get_num_fig_managers()
    path = save_figure(plot_balance(plan), tmp_path / "sub" / "b.svg")
    assert _pylab_helpers.Gcf.get_num_fig_managers() == before
    assert path.read_text().lstrip().startswith("<?xml")
    assert [p.name for p in path.parent.iterdir()] == ["b.svg"]  # no temporary file left
    with pytest.raises(PlotError, match="already exists: refusing to overwrite"):
        save_figure(plot_balance(plan), path)
    with pytest.raises(PlotError, match="unknown image type '.txt'"):
        save_figure(plot_balance(plan), tmp_path / "b.txt")


def test_plot_module_imports_without_torch() -> None:
    code = "import sys, autopipe.plot; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture
def files(tmp_path: Path, profile: Profile, plan: Plan) -> tuple[Path, Path]:
    return plan.save(tmp_path / "plan.json"), profile.save(tmp_path / "prof.csv")


def test_cli_plot_writes_each_figure(files: tuple[Path, Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    plan_path, prof_path = files
    for extra, name in [([], "balance.png"), (["--timeline", "--schedule", "1f1b"], "t.png"),
                        (["--layers", "--profile", str(prof_path)], "layers.png"),
                        (["--profile", str(prof_path)], "checked.png")]:
        out = tmp_path / name
        assert main(["plot", str(plan_path), "--out", str(out), *extra]) == 0
        assert out.read_bytes().startswith(PNG)
        assert capsys.readouterr().out.strip() == f"wrote {out}"


def test_cli_plot_refuses_to_overwrite(files: tuple[Path, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b.png"
    out.write_bytes(b"keep me")
    assert main(["plot", str(files[0]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists: refusing to overwrite it; pass --force" in err
    assert out.read_bytes() == b"keep me"
    assert main(["plot", str(files[0]), "--out", str(out), "--force"]) == 0
    assert out.read_bytes().startswith(PNG)


def test_cli_plot_bad_inputs(files: tuple[Path, Path], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    plan_path, prof_path = files
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(plan_path.read_text()[:200])
    not_plan = tmp_path / "other.json"
    not_plan.write_text(json.dumps({"format": "something else"}))
    other = chain_profile([1.0] * 4).save(tmp_path / "chain.csv")
    broken = tmp_path / "broken.csv"
    broken.write_text("layer,fwd_ms\nx,notanumber\n")
    broken.with_suffix(".json").write_text("{}")
    out = str(tmp_path / "x.png")
    cases = [
        (["plot", str(corrupt), "--out", out], PlanError, "is not valid JSON"),
        (["plot", str(not_plan), "--out", out], PlanError, "is not an autopipe plan"),
        (["plot", str(tmp_path / "missing.json"), "--out", out], PlanError, "does not exist"),
        (["plot", str(plan_path), "--out", out, "--profile", str(other)], PlanError, "not in the graph"),
        (["plot", str(plan_path), "--out", out, "--profile", str(broken)], ProfileError, "lacks required column"),
        (["plot", str(plan_path), "--out", out, "--layers"], PlotError, "pass --profile"),
        (["plot", str(plan_path), "--out", out, "--timeline", "--schedule", "zb"], PlanError, "is not simulated"),
        (["plot", str(plan_path), "--out", str(tmp_path / "x.doc")], PlotError, "unknown image type"),
    ]
    for argv, kind, match in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("autopipe: error: ") and err.count("\n") == 1, err
        assert match in err, err
        args = build_parser().parse_args(argv)  # the same handler, without main's catch-all
        with pytest.raises(kind, match=re.escape(match)) as raised:
            args.func(args)
        assert type(raised.value) is kind, argv
    assert not (tmp_path / "x.png").exists()


def test_readme_images(tmp_path: Path) -> None:
    prof = transformer_dag(2).save(tmp_path / "gpt.csv")
    paths = readme_images(tmp_path / "img", profile=prof, stages=3, chunks=4)
    assert [p.name for p in paths] == ["balance.png", "timeline.png"]
    assert all(p.read_bytes().startswith(PNG) for p in paths)


def test_timeline_draws_the_data_parallel_collectives() -> None:
    # [Note: pipeline x data parallel]: 2 FSDP replicas; gathers and reduce-scatters as strips
    prof = chain_profile([1.0, 1.0], param_bytes=[1 << 20, 5 << 20])
    plan = Plan.from_stages(prof, [["l0"], ["l1"]], chunks=2, recompute="never", bandwidth=1e9,
                            data_parallel=2, dp_mode="fsdp")
    result = simulate(plan)
    ax = plot_timeline(result).axes[0]
    assert len(bars(ax)) == len(result.timeline)
    assert len([b for b in bars(ax) if b.get_height() < 0.2]) == 4  # 2 gathers, 2 reduce-scatters
    assert {"allgather", "reducescatter"} <= set(legend_labels(ax))
    assert bubble_fraction(result.timeline) == pytest.approx(result.bubble_fraction)
    assert len(bars(plot_balance(plan).axes[0])) == 4 * 2  # per micro-batch phases only
