"""Profiling graphs of many tiny layers stays bounded; HF Mamba pipelines exactly (issue 22).

The bounds are measured in fresh interpreters (RssAnon: [Note: RssAnon]) on the graphs as traced,
layer by layer (``leaf_modules=[]``: no [Note: automatic granularity]), so every tiny layer is
profiled; [Note: a layer that returns a parameter] is what made them grow.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import autopipe
from autopipe.frontend.profiling.process_memory import rss_anon

GiB = 2**30

_MEASURE = textwrap.dedent("""
    import json, sys, time, torch
    import autopipe
    from autopipe.frontend.profiling.process_memory import PeakRss
    from tests.frontend.many_layers import Scan, tiny_mamba

    def bounds(model, x, chunks):
        with PeakRss() as traced:
            g = autopipe.trace(model, (x[: x.shape[0] // chunks],), leaf_modules=[])
        start = time.perf_counter()
        with PeakRss() as profiled:
            autopipe.profile(model, (x,), chunks=chunks, graph=g, repeats=2, warmup=1)
        return {"layers": len(g.layers), "seconds": time.perf_counter() - start,
                "traced": traced.above_start, "profiled": profiled.bytes - traced.start}

    torch.manual_seed(0)
    if sys.argv[1] == "scan":
        print(json.dumps(bounds(Scan(steps=260), torch.randn(4, 260, 8), 2)))
    else:
        print(json.dumps(bounds(tiny_mamba(1), torch.randint(0, 256, (4, 8)), 2)))
""")


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    if rss_anon() is None:
        pytest.skip("needs Linux /proc/self/status")
    pytest.importorskip("transformers")
    # one fresh interpreter per model, side by side: each measures only itself
    procs = {name: subprocess.Popen([sys.executable, "-c", _MEASURE, name], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name in ("scan", "mamba")}
    result: dict[str, Any] = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=240)
            assert proc.returncode == 0, stderr[-2000:]
            result[name] = json.loads(stdout.splitlines()[-1])
    finally:
        for proc in procs.values():
            proc.kill()
    return result


@pytest.mark.slow  # a fresh interpreter each: tracing 1,044 layers takes most of its ~15 s
def test_a_scan_of_over_a_thousand_layers_profiles_in_bounded_time_and_memory(measured: dict[str, Any]) -> None:
    scan = measured["scan"]
    assert scan["layers"] > 1000
    assert scan["seconds"] < 60  # the bound on 2 shared cores (it took ~5 s)
    assert scan["profiled"] - scan["traced"] < 1 * GiB  # over what tracing took


@pytest.mark.slow  # a fresh interpreter each: tracing 1,044 layers takes most of its ~15 s
def test_mamba_profiles_within_a_bounded_memory(measured: dict[str, Any]) -> None:
    mamba = measured["mamba"]
    assert mamba["layers"] > 60  # the selective scan unrolled over 8 tokens
    assert mamba["profiled"] - mamba["traced"] < 1 * GiB  # it grew past 10 GiB within a minute


def test_mamba_through_a_pipeline_has_the_plain_model_loss_and_gradients() -> None:
    pytest.importorskip("transformers")
    from tests.frontend.many_layers import tiny_mamba

    model = tiny_mamba(1)
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    plain = copy.deepcopy(model)
    g = autopipe.trace(model, (ids[:2],))
    assert g.grouped and all(name.endswith(".mixer") for name in g.grouped)  # one layer per mixer
    prof = autopipe.profile(model, (ids,), chunks=2, graph=g, repeats=1, warmup=0)
    pipe = autopipe.pipeline(model, (ids,), devices=["cpu", "cpu"], chunks=2, graph=g, profile=prof)
    loss = pipe(ids).logits.float().logsumexp(-1).mean()  # the pipeline returns what the model does
    loss.backward()
    expected = plain(ids).logits.float().logsumexp(-1).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert p.is_leaf, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)
