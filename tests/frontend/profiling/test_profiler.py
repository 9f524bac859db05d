from __future__ import annotations

import copy
import io
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
import pytest
import torch
from torch import nn

import autopipe
from autopipe import ProfileError
from autopipe.core.corrections import Phases
from autopipe.core.profile_table import Profile
from autopipe.examples import get_example
from autopipe.frontend.profiling.corrections.in_sequence import MAX_ROUNDS_PER_REPEAT
from autopipe.frontend.profiling.corrections.overheads import CALL_REPEATS, CALL_WARMUP
from autopipe.frontend.profiling.harness.inputs import micro_batch
from autopipe.frontend.profiling.harness.timing import Timer
from autopipe.frontend.profiling.profiler import DEFAULT_REPEATS, profile, time_model
from autopipe.frontend.tracing.graph import trace
from tests.conftest import skip_if_no_cuda
from tests.models import BNNet, Chain, Dropouty, Skip

T = TypeVar("T")
FAST = {"repeats": 3, "warmup": 1}


def test_profile_table_edges_and_meta() -> None:
    ex = get_example("mlp", batch_size=10)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=4, **FAST)
    micro = ex.inputs[0][:3]  # ceil(10 / 4) = 3 rows
    g = trace(ex.model, (micro,))
    assert prof.layers == g.layers
    assert prof.edges == g.edges()
    assert prof.edges[0] == ("net.0", "net.1", 3 * 512 * 4)  # bytes at the micro-batch
    for col in ("layer", "fwd_ms", "bwd_ms", "param_bytes", "output_bytes", "saved_bytes",
                "peak_bytes", "buffer_bytes", "shared_bytes", "tie_group", "kind", "module_type"):
        assert col in prof.df.columns, col
    assert (prof.df["fwd_ms"] >= 0).all() and (prof.df["bwd_ms"] >= 0).all()
    assert prof.df["peak_bytes"].isna().all()  # the CPU reports no peak memory
    row = prof.df.set_index("layer").loc["net.0"]
    assert row["param_bytes"] == (64 * 512 + 512) * 4
    assert row["output_bytes"] == 3 * 512 * 4
    assert row["saved_bytes"] == 3 * 64 * 4  # Linear keeps its input (not its weight) for backward
    m = prof.meta
    assert (m["batch_size"], m["chunks"], m["micro_batch_size"]) == (10, 4, 3)
    assert m["fingerprint"] == g.fingerprint and m["model"] == "UnevenMLP"
    assert m["device"] == "cpu" and m["dtype"] == "float32" and m["torch_version"] == torch.__version__
    assert (m["repeats"], m["warmup"], m["cpu_threads"]) == (3, 1, torch.get_num_threads())
    assert "date" in m and prof.corrections.harness is not None  # the harness: a correction, not meta


def test_skip_connection_edges_and_saved_bytes() -> None:
    x = torch.randn(6, 8)
    prof = profile(Skip(), (x,), **FAST)
    assert ("a", "add", 6 * 8 * 4) in prof.edges  # the skip from a to the add after c
    saved = prof.df.set_index("layer")["saved_bytes"]
    # a Linear keeps its input for the weight gradient, even a graph input
    assert saved["a"] == saved["b"] == saved["d"] == 6 * 8 * 4
    assert saved["add"] == 0  # an addition needs nothing for its backward
    # of it, the inputs from other layers ([Note: an input kept once]): not the caller's batch
    kept = prof.df.set_index("layer")["saved_input_bytes"]
    assert kept["a"] == 0 and kept["b"] == kept["d"] == 6 * 8 * 4 and kept["add"] == 0


def test_micro_batch_slicing_and_bad_batches() -> None:
    x, y = torch.randn(10, 3), torch.randn(10)
    (xs, ys), batch, micro = micro_batch((x, y), 3)
    assert (batch, micro, xs.shape[0], ys.shape[0]) == (10, 4, 4, 4)
    with pytest.raises(ProfileError, match=r"chunks=16 > batch size 8.*chunks <= 8"):
        micro_batch(torch.randn(8, 2), 16)
    with pytest.raises(ProfileError, match="chunks must be an int >= 1"):
        micro_batch(torch.randn(8, 2), 0)
    with pytest.raises(ProfileError, match=r"disagree on the batch size.*\[4, 8\]"):
        micro_batch((torch.randn(8, 2), torch.randn(4, 2)), 2)
    with pytest.raises(ProfileError, match="no tensor with a batch dimension"):
        micro_batch((3, torch.tensor(1.0)), 1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"device": "cuda:0"} if not torch.cuda.is_available() else {"device": "cuda:99"},
         r"CUDA is not available|does not exist"),
        ({"device": "meta"}, "only 'cpu' and 'cuda"),
        ({"device": "nonsense"}, "is not a torch device"),
        ({"repeats": 0}, "repeats must be an int >= 1"),
        ({"warmup": -1}, "warmup must be an int >= 0"),
        ({"chunks": 9}, r"chunks=9 > batch size 8"),
        ({"leaf_module": ["net.0"]}, r"unknown argument\(s\) \['leaf_module'\]"),
        ({"progress": "yes"}, "progress must be True, False or None"),
    ],
)
def test_bad_arguments_are_one_line_profile_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ProfileError, match=match) as info:
        profile(Chain(), (torch.randn(8, 8),), **kwargs)
    assert "\n" not in str(info.value)


def test_not_a_module() -> None:
    with pytest.raises(ProfileError, match="needs an nn.Module"):
        profile(lambda x: x, (torch.randn(2, 2),))  # type: ignore[arg-type]


def test_given_graph_must_be_traced_on_the_micro_batch() -> None:
    model, x = Chain(), torch.randn(8, 8)
    g = trace(model, (x[:2],))
    prof = profile(model, (x,), chunks=4, graph=g, **FAST)
    assert prof.fingerprint == g.fingerprint and prof.layers == g.layers
    torch.testing.assert_close(g.gm(x[:2]), model(x[:2]))  # the caller's graph still runs
    with pytest.raises(ProfileError, match=r"traced with input shapes \[\[2, 8\]\].*\[\[8, 8\]\]"):
        profile(model, (x,), chunks=1, graph=g, **FAST)


def test_save_load_round_trip(tmp_path: Path) -> None:
    ex = get_example("gpt", batch_size=4)
    prof = profile(ex.model, ex.inputs, chunks=2, name="gpt", **FAST)
    path = prof.save(tmp_path / "gpt.csv")
    back = Profile.load(path)
    pd.testing.assert_frame_equal(back.df, prof.df, check_dtype=False)
    assert back.edges == prof.edges
    assert back.meta == prof.meta
    # the tied embedding / head share one group
    ties = prof.df.set_index("layer")["tie_group"]
    assert ties["tok"] == ties["head"] == "tok.weight"


def test_profile_of_another_model_is_refused() -> None:
    x = torch.randn(4, 8)
    prof = profile(Chain(), (x,), **FAST)
    prof.check_fingerprint(trace(Chain(), (x,)).fingerprint)  # same structure: accepted
    other = trace(Chain((8, 32, 4)), (x,)).fingerprint
    with pytest.raises(ProfileError, match=rf"profile fingerprint {prof.fingerprint} does not match"):
        prof.check_fingerprint(other)


class InplaceNet(nn.Module):
    """An in-place ReLU right after a layer AND directly on a graph input."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.ReLU(inplace=True)
        self.fc1 = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(self.pre(x)))
        return self.fc2(h).add_(1.0)


@pytest.mark.parametrize("make", [InplaceNet, lambda: get_example("cnn", 4).model])
def test_in_place_layers_profile(make: Callable[[], nn.Module]) -> None:
    model = make()
    x = torch.randn(4, 8) if isinstance(model, InplaceNet) else torch.randn(4, 3, 16, 16)
    x_before = x.clone()
    prof = profile(model, (x,), **FAST)
    torch.testing.assert_close(x, x_before)  # the caller's inputs are not written either
    df = prof.df.set_index("layer")
    assert df["fwd_ms"].map(math.isfinite).all()
    relu = "act" if isinstance(model, InplaceNet) else "stem_relu"
    assert df.loc[relu, "saved_bytes"] > 0  # relu keeps its output for backward
    # which is its input's storage, written in place: a stage it starts writes a copy of its
    # input, so the input that stage keeps is not what it saves ([Note: an input kept once])
    assert df.loc[relu, "saved_input_bytes"] == 0


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "grads": {k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()},
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "modes": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("params", "buffers"):
        assert a[key].keys() == b[key].keys()
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
    for k, g in a["grads"].items():
        assert (g is None) == (b["grads"][k] is None), k
        if g is not None:
            assert torch.equal(g, b["grads"][k]), k
    assert a["modes"] == b["modes"]
    assert torch.equal(a["rng"], b["rng"])


@pytest.mark.parametrize("make", [BNNet, Dropouty])
def test_profiling_leaves_model_unchanged(make: Callable[[], nn.Module]) -> None:
    model = make()
    x = torch.randn(8, 3, 6, 6) if isinstance(model, BNNet) else torch.randn(8, 16)
    model(x).sum().backward()  # some existing gradients that must survive
    model.eval()
    model.training = True  # a mixed mode must come back exactly
    params = [id(p) for p in model.parameters()]
    before = _state(model)
    ref = copy.deepcopy(model)
    profile(model, (x,), chunks=2, **FAST)
    _assert_same(before, _state(model))
    assert [id(p) for p in model.parameters()] == params
    model.eval(), ref.eval()
    torch.testing.assert_close(model(x), ref(x))


def test_relative_costs_rank_an_uneven_mlp() -> None:
    # layer 'small' does 64x64 MACs per row, 'wide' and 'narrow' 64x1024: 16x the FLOPs
    model = nn.Sequential()
    model.add_module("small", nn.Linear(64, 64))
    model.add_module("wide", nn.Linear(64, 1024))
    model.add_module("narrow", nn.Linear(1024, 64))
    model.add_module("small2", nn.Linear(64, 64))
    prof = profile(model, (torch.randn(128, 64),), repeats=5, warmup=2)
    cost = (prof.df["fwd_ms"] + prof.df["bwd_ms"]).set_axis(prof.layers)
    assert max(cost["small"], cost["small2"]) < min(cost["wide"], cost["narrow"]), cost.to_dict()
    fwd = prof.df.set_index("layer")["fwd_ms"]
    assert max(fwd["small"], fwd["small2"]) < min(fwd["wide"], fwd["narrow"]), fwd.to_dict()


class CountingTimer(Timer):
    """Reports 1 ms per call, and counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, fn: Callable[[], T]) -> tuple[T, float]:
        self.calls += 1
        return fn(), 1.0


def test_repeats_warmup_and_harness_subtraction_with_a_fake_timer() -> None:
    model, x = Chain((8, 8, 8)), torch.randn(4, 8)  # Linear, ReLU, Linear: all need backward
    timer = CountingTimer()
    prof = profile(model, (x,), repeats=4, warmup=3, timer=timer)
    calibration = 2 * (50 + 2)  # the empty layer: forward + backward per run
    # the empty stage call, plain and checkpointed: [Note: measured overheads]
    calibration += 2 * 2 * (CALL_REPEATS + CALL_WARMUP)
    # the whole graph in sequence, then as one GPipe stage never / always, in turns, for the
    # repeats at least and then until its time budget: [Note: layers in sequence]
    assert prof.corrections.sequence is not None
    rounds = prof.corrections.sequence.rounds
    assert 4 <= rounds <= MAX_ROUNDS_PER_REPEAT * 4
    calibration += 3 * 2 * (rounds + 3)
    # [Note: split backward measured]: each half on the 1-element layer, then one split backward
    # per layer: the first Linear's input needs no gradient (one whole W), the others two halves
    calibration += 2 * 50 + 1 + 2 + 2
    assert timer.calls == calibration + len(prof) * 2 * (4 + 3)
    # every call "takes" 1 ms, exactly what the empty layer takes: nothing is left
    assert prof.corrections.harness == Phases(1.0, 1.0)
    assert (prof.df["fwd_ms"] == 0).all() and (prof.df["bwd_ms"] == 0).all()
    # no layer left with a forward to recompute: the ratio stays today's
    assert prof.corrections.recompute_ratio == 1.0


def test_time_model_measures_forward_and_backward() -> None:
    ex = get_example("mlp", batch_size=8)
    fwd, bwd = time_model(ex.model, ex.inputs, chunks=2, **FAST)
    assert fwd > 0 and bwd > 0
    assert all(p.grad is None for p in ex.model.parameters())


@pytest.mark.slow
def test_huggingface_gpt2_from_config() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (4, 16))
    before = _state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile(model, (ids,), chunks=2, **FAST)
        g = trace(model, (ids[:2],))
    _assert_same(before, _state(model))
    assert prof.meta["source"] == "export" and prof.layers == g.layers
    assert prof.fingerprint == g.fingerprint
    df = prof.df.set_index("layer")
    assert df.loc["transformer.wte", "tie_group"] == df.loc["lm_head", "tie_group"] != ""
    assert df.loc["transformer.wte", "saved_bytes"] == 2 * 16 * 8  # the int64 token ids
    assert df["saved_bytes"].sum() > 0 and df["fwd_ms"].map(math.isfinite).all()


def test_hundred_layer_model_profiles_with_the_defaults() -> None:
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(100)])
    prof = profile(model, (torch.randn(32, 16),), chunks=4)  # default repeats / warmup
    assert len(prof) == 100 and prof.meta["repeats"] == DEFAULT_REPEATS


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("progress,terminal,shown", [
    (None, True, True),  # the default on a terminal: a bar over the layers
    (None, False, False),  # the default off a terminal (pytest's capture): silent
    (False, True, False),  # progress=False: silent even on a terminal
    (True, False, True),  # progress=True: shown anyway
])
def test_progress_bar_by_default_on_a_terminal(progress: bool | None, terminal: bool, shown: bool,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    if terminal:
        monkeypatch.setattr(sys, "stderr", _Terminal())
    prof = profile(Chain(), (torch.randn(8, 8),), progress=progress, **FAST)
    err = sys.stderr.getvalue() if terminal else capsys.readouterr().err  # type: ignore[attr-defined]
    n = len(prof)
    assert ("profiling:" in err and f"/{n} [" in err) is shown, err  # "profiling: 0%| | 0/7 ["
    if not shown:
        assert err == ""


def test_accuracy_benchmark_smoke() -> None:
    from benchmarks.profile_accuracy import main

    table = main(["--examples", "mlp", "--rounds", "1", "--repeats", "2", "--warmup", "0"])
    header, _, row = table.splitlines()
    assert header.startswith("| example | layers | micro-batch")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["mlp", "15", "64"]  # the example's layers and micro-batch (256 / 4)
    summed, whole, ratio = float(cells[3]), float(cells[4]), float(cells[5])
    assert summed > 0 and whole > 0 and ratio == pytest.approx(summed / whole, abs=0.006)
    assert cells[7] in ("yes / yes", "yes / no", "no / yes", "no / no")


@skip_if_no_cuda
def test_cuda_profile_reports_peak_memory_and_moves_back() -> None:
    ex = get_example("mlp", batch_size=8)
    prof = profile(ex.model, ex.inputs, device="cuda", chunks=2, **FAST)
    assert prof.meta["device"] == torch.cuda.get_device_name(0)
    assert prof.meta["device_type"] == "cuda"
    assert prof.df["peak_bytes"].notna().all() and (prof.df["peak_bytes"] > 0).any()
    assert all(p.device.type == "cpu" for p in ex.model.parameters())
    assert (prof.df["fwd_ms"] >= 0).all()


def test_cli_profile_no_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autopipe.app.cli import main

    argv = ["profile", "tests.models:make_chain", "--repeats", "1", "--warmup", "0"]
    assert main([*argv, "--out", str(tmp_path / "a.csv")]) == 0
    assert "profiling" in capsys.readouterr().err  # the command's bar is on unless told
    assert main([*argv, "--out", str(tmp_path / "b.csv"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_the_backward_working_set_is_each_layers_new_gradients() -> None:
    # [Note: the backward's memory]: a Linear's backward allocates its weight's gradient, and its
    # input's where the input needs one (the first layer's batch does not)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 32, bias=False))
    prof = autopipe.profile(model, (torch.randn(4, 8),), chunks=1, repeats=1, warmup=0)
    assert prof.df["bwd_working_bytes"].tolist() == [16 * 8 * 4, 4 * 16 * 4 + 32 * 16 * 4]
