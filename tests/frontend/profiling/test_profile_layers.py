"""profile(mode="layers"): models on the meta device, or larger than a budget, layer by layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopipe
from autopipe.errors import ProfileError
from autopipe.examples import TinyGPT
from autopipe.frontend.profiling.harness.process_memory import rss_anon
from tests import forked
from tests.models import Chain, tiny_llama

FAST = {"repeats": 1, "warmup": 0, "progress": False}


def test_a_meta_model_is_profiled_layer_by_layer() -> None:
    with torch.device("meta"):
        model = TinyGPT(layers=3)
    ids = torch.randint(0, 256, (4, 16))
    prof = autopipe.profile(model, (ids,), chunks=2, **FAST)
    graph = autopipe.trace(model, (ids[:2],))
    assert prof.meta["mode"] == "layers" and prof.meta["dedupe"] is True
    assert prof.layers == graph.layers and prof.fingerprint == graph.fingerprint
    df = prof.df.set_index("layer")
    assert df.loc["blocks.2.fc1", "measured_as"] == "blocks.0.fc1"
    assert df.loc["blocks.0.fc1", "measured_as"] == "blocks.0.fc1"
    for column in ("fwd_ms", "bwd_ms", "saved_bytes"):
        assert df.loc["blocks.2.fc1", column] == df.loc["blocks.0.fc1", column]
    assert prof.meta["measured_layers"] == int((df.index == df["measured_as"]).sum()) < len(df)
    assert df.loc["blocks.0.fc1", "saved_bytes"] > 0 and df.loc["blocks.0.fc1", "param_bytes"] > 0
    assert prof.meta["peak_memory_bytes"] is None or prof.meta["peak_memory_bytes"] > 0
    assert all(p.is_meta for p in model.parameters())
    every = autopipe.profile(model, (ids,), chunks=2, dedupe=False, **FAST)
    assert every.meta["measured_layers"] == len(every.df)
    assert (every.df["layer"] == every.df["measured_as"]).all()


@pytest.mark.compat
def test_a_meta_hf_llama_is_profiled_layer_by_layer_like_the_real_one_whole() -> None:
    """The GPU check's 70B step at a tiny size: each layer of a meta-built HF Llama measured
    alone on the CPU, under every transformers the compat jobs hold (5.17 puts its rotary
    embedding's body in a graph of its own: [Note: nested graphs])."""
    meta, real = tiny_llama(meta=True), tiny_llama()
    ids = torch.randint(0, 64, (4, 8))
    layers = autopipe.profile(meta, (ids,), chunks=2, **FAST)
    whole = autopipe.profile(real, (ids,), chunks=2, mode="whole", **FAST)
    assert layers.meta["mode"] == "layers" and whole.meta["mode"] == "whole"
    assert layers.meta["measured_layers"] < len(layers)  # the second decoder layer is the first's twin
    # the real model's own run, layer for layer (the two traces name some nodes differently)
    sizes = ["param_bytes", "output_bytes", "saved_bytes", "buffer_bytes", "kind"]
    assert layers.df[sizes].reset_index(drop=True).equals(whole.df[sizes].reset_index(drop=True))
    assert all(p.is_meta for p in meta.parameters())  # nothing of the model was allocated


def test_layer_by_layer_gives_the_whole_model_columns() -> None:
    model = Chain()
    x = torch.randn(8, 8)
    whole = autopipe.profile(model, (x,), chunks=2, mode="whole", **FAST)
    layers = autopipe.profile(model, (x,), chunks=2, mode="layers", dedupe=False, **FAST)
    assert whole.meta["mode"] == "whole" and layers.meta["mode"] == "layers"
    assert list(whole.df.columns) == list(layers.df.columns)
    same = ["layer", "param_bytes", "output_bytes", "saved_bytes", "buffer_bytes", "kind"]
    assert whole.df[same].equals(layers.df[same])
    assert whole.edges == layers.edges and whole.fingerprint == layers.fingerprint
    auto = autopipe.profile(model, (x,), chunks=2, memory_budget="1KB", **FAST)
    assert auto.meta["mode"] == "layers"  # the model's 1.4 KB of parameters exceed the budget
    assert autopipe.profile(model, (x,), chunks=2, memory_budget="1GB", **FAST).meta["mode"] == "whole"


def test_bad_modes_are_one_line_errors() -> None:
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(ProfileError, match="has tensors on the meta device, so it cannot run "
                                           "whole; profile it layer by layer: mode='layers'"):
        autopipe.profile(meta, (x,), mode="whole", **FAST)
    with pytest.raises(ProfileError, match=r"mode='fast' is unknown; use one of \['auto', 'whole', 'layers'\]"):
        autopipe.profile(nn.Linear(4, 4), (x,), mode="fast", **FAST)
    with pytest.raises(ProfileError, match="cannot read memory size 'lots'"):
        autopipe.profile(nn.Linear(4, 4), (x,), memory_budget="lots", **FAST)


def _trace_and_profile_peaks() -> tuple[int, int | None, int | None]:
    """The 5 GB meta TinyGPT's parameter bytes, the peak RssAnon of tracing it, and then the
    peak of profiling it from that trace, in this one process."""
    from autopipe.frontend.profiling.harness.process_memory import PeakRss

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = TinyGPT(vocab=16000, dim=2048, heads=16, layers=25, max_len=64)
    ids = torch.randint(0, 16000, (2, 64))
    with PeakRss() as traced:
        graph = autopipe.trace(model, (ids[:1],))
    with PeakRss() as profiled:
        prof = autopipe.profile(model, (ids,), chunks=2, graph=graph, repeats=1, warmup=0, progress=False)
    assert prof.meta["mode"] == "layers"
    assert (prof.df["fwd_ms"] > 0).all() and (prof.df["bwd_ms"] > 0).all(), prof.df
    return sum(p.numel() * p.element_size() for p in model.parameters()), traced.bytes, profiled.bytes


@pytest.mark.slow
@pytest.mark.skipif(rss_anon() is None, reason="needs Linux /proc/self/status")
@pytest.mark.timeout(240)
def test_a_5gb_meta_model_profiles_within_1gib_of_tracing_it() -> None:
    # In a process of its own ([Note: processes forked from a server]): RssAnon of what it alone
    # allocated ([Note: RssAnon]). Tracing, then profiling from that trace: the profile's peak
    # counts what the trace left behind, as profile() tracing the model itself would (it did so
    # in a second process, tracing the model a second time).
    child = forked.start(_trace_and_profile_peaks)
    try:
        size, traced, profiled = child.result(timeout=220)
    finally:
        child.kill()
    assert traced is not None and profiled is not None
    assert size >= 5e9  # bytes of fp32 parameters the profiler never allocated
    assert profiled - traced <= 2**30, {"trace": traced, "profile": profiled}


@pytest.mark.slow
def test_giant_benchmark_runs_tiny() -> None:
    pytest.importorskip("transformers")
    from benchmarks.giant import main

    # two decoder layers: the second measured as the first's twin, as the 1B shape's 21 are
    phases = main(["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4",
                   "--kv-heads", "2", "--vocab", "128", "--seq", "16", "--batch", "4",
                   "--chunks", "2", "--stages", "2", "--repeats", "1", "--threads", "1"])
    assert [p.name for p in phases] == ["build on meta", "trace", "profile (layer by layer)",
                                        "partition into 2 stages"]
    assert all(p.seconds > 0 for p in phases)
    assert "layers measured, layers" in phases[2].note and "bottleneck" in phases[3].note
    # estimated on a sheet, then planned for its devices with every choice the planner's
    tiny = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
            "--vocab", "128", "--seq", "16", "--batch", "4", "--chunks", "2", "--threads", "1"]
    phases = main([*tiny, "--estimate", "h100", "--precision", "bf16", "--devices", "4"])
    assert [p.name for p in phases][2:] == ["profile (estimated on h100)",
                                            "partition: stages, chunks, recompute auto on 4 devices"]
    assert "layers counted" in phases[2].note and "per device" in phases[3].note


def test_several_micro_batch_sizes_feed_chunks_auto() -> None:
    model = Chain()
    x = torch.randn(8, 8)
    prof = autopipe.profile(model, (x,), chunks=4, micro_batch_sizes=[1, 2, 16], **FAST)
    assert prof.meta["micro_batch_size"] == 2 and prof.meta["micro_batch_sizes"] == [1, 2, 16]
    for r in (1, 16):  # 16 rows: the example batch of 8, twice
        for column in ("fwd_ms", "bwd_ms", "saved_bytes", "output_bytes"):
            assert f"{column}@{r}" in prof.df.columns
    # activations are per row: exactly 8x the 2-row micro-batch's at 16 rows
    assert (prof.df["output_bytes@16"] == 8 * prof.df["output_bytes"]).all()
    assert set(prof.meta["fingerprints"]) == {"1", "2", "16"}
    plan = autopipe.partition(prof, stages=2, chunks="auto", batch_size=32)
    assert 1 <= plan.chunks <= 32
    with pytest.raises(ProfileError, match="micro_batch_sizes must be row counts >= 1"):
        autopipe.profile(model, (x,), chunks=4, micro_batch_sizes=[0, 2], **FAST)
