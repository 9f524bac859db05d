"""profile(..., estimate=SHEET): rows counted by hand, the same columns as a measured profile,
every downstream step unchanged, and one line for what it cannot take."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest
import torch
from torch import nn

import autopipe
from autopipe.core.device_sheet import DeviceSheet, load_sheet
from autopipe.core.profile_table import Profile
from autopipe.errors import ProfileError
from autopipe.plot import plot_balance, plot_profile, plot_timeline

matplotlib.use("Agg")
B, CHUNKS, K, N, OUT = 16, 2, 64, 128, 4
M = B // CHUNKS  # rows of one micro-batch
PEAK, EFF = 1e9, 0.5


def _compute_only() -> DeviceSheet:
    """A sheet on which only FLOPs cost time: an op's ms is 1e3 x flops / (PEAK x EFF)."""
    data = load_sheet("h100").to_json()
    data.update(name="flops-only", peak_flops_fp32=PEAK, memory_bandwidth=1e30, efficiency_matmul=EFF,
                efficiency_elementwise=1.0, launch_us=1e-9, memory_bytes=2**30)
    return DeviceSheet.from_json(data, "test")


def _ms(flops: int) -> float:
    return 1e3 * flops / (PEAK * EFF)


@pytest.fixture(scope="module")
def chain() -> tuple[nn.Module, torch.Tensor, Profile]:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(K, N), nn.ReLU(), nn.Linear(N, OUT))
    x = torch.randn(B, K)
    return model, x, autopipe.profile(model, (x,), chunks=CHUNKS, estimate=_compute_only(), progress=False)


def test_each_layer_is_its_matmuls_flops_on_the_sheet_and_its_bytes_to_the_byte(chain) -> None:
    model, _, prof = chain
    df = prof.df.set_index("layer")
    first, relu, last = df.loc["0"], df.loc["1"], df.loc["2"]
    assert first["fwd_ms"] == pytest.approx(_ms(2 * M * K * N), abs=1e-6)
    # the first layer's input is the batch: its backward is the weights' gradient only
    assert first["bwd_ms"] == pytest.approx(_ms(2 * M * K * N), abs=1e-6)
    assert last["fwd_ms"] == pytest.approx(_ms(2 * M * N * OUT), abs=1e-6)
    assert last["bwd_ms"] == pytest.approx(_ms(2 * 2 * M * N * OUT), abs=1e-6)
    assert last["bwd_input_ms"] == pytest.approx(_ms(2 * M * N * OUT), abs=1e-6)
    assert relu["fwd_ms"] == pytest.approx(0.0, abs=1e-6)  # no FLOPs, free bytes
    assert list(df["param_bytes"]) == [4 * (K * N + N), 0, 4 * (N * OUT + OUT)]
    assert list(df["output_bytes"]) == [4 * M * N, 4 * M * N, 4 * M * OUT]
    # each Linear saves its input, the ReLU its output, which the last Linear's input is
    assert list(df["saved_bytes"]) == [4 * M * K, 4 * M * N, 4 * M * N]
    assert list(df["saved_shared_bytes"]) == [4 * M * K, 0, 4 * M * N]
    assert all(p.is_meta for p in model.parameters())  # nothing of the model was allocated


def test_an_estimate_has_the_columns_of_a_measured_profile_and_says_where_it_came_from(chain) -> None:
    model, x, prof = chain
    measured = autopipe.profile(model, (x,), chunks=CHUNKS, repeats=1, warmup=0, progress=False)
    assert set(prof.df.columns) == set(measured.df.columns) | {"estimated"}
    for column in ("param_bytes", "output_bytes", "saved_bytes", "saved_shared_bytes", "saved_input_bytes",
                   "weight_grad_bytes", "buffer_bytes", "bwd_working_bytes", "returned_bytes"):
        assert list(prof.df[column]) == list(measured.df[column]), column
    assert prof.fingerprint == measured.fingerprint and prof.layers == measured.layers
    assert set(prof.df["estimated"]) == {"flops-only"}
    assert prof.meta["estimated"]["name"] == "flops-only" and prof.meta["device_type"] == "cuda"
    assert prof.corrections.transfer is not None and prof.corrections.transfer.bandwidth == 50e9


def test_partition_simulate_explain_and_plot_take_an_estimate_unchanged(chain, tmp_path: Path) -> None:
    _, _, prof = chain
    prof.save(tmp_path / "est.csv")
    loaded = Profile.load(tmp_path / "est.csv")
    assert loaded.meta["estimated"] == prof.meta["estimated"] and loaded.df.equals(prof.df)
    plan = autopipe.partition(loaded, stages=2, chunks=CHUNKS, schedule="auto")
    assert plan.estimated_from == "flops-only (NVIDIA H100 SXM5 80GB)"
    assert plan.explain().splitlines()[0].startswith("ESTIMATED, not measured: every time and byte below "
                                                     "was counted on device sheet flops-only")
    assert "interleaved_zb" not in plan.skipped_schedules  # the split backward was counted too
    assert all(d.memory == 2**30 for d in plan.devices)  # the sheet's memory, unless told
    assert autopipe.simulate(plan, loaded).iteration_time == pytest.approx(plan.iteration_time)
    plan.save(tmp_path / "plan.json")
    assert autopipe.Plan.load(tmp_path / "plan.json") == plan
    for figure in (plot_balance(plan), plot_profile(loaded, plan), plot_timeline(autopipe.simulate(plan))):
        assert figure.axes


def test_bad_estimates_are_one_line(chain, tmp_path: Path) -> None:
    model, x, _ = chain
    with pytest.raises(ProfileError, match="no device sheet 'rtx9090': shipped sheets are"):
        autopipe.profile(model, (x,), chunks=CHUNKS, estimate="rtx9090")
    with pytest.raises(ProfileError, match="device='cuda' has no use"):
        autopipe.profile(model, (x,), chunks=CHUNKS, estimate="h100", device="cuda")
    with pytest.raises(ProfileError, match="comm=True would put this host's measured link"):
        autopipe.profile(model, (x,), chunks=CHUNKS, estimate="h100", comm=True)
    with pytest.raises(ProfileError, match="mode='whole' cannot run"):
        autopipe.profile(model, (x,), chunks=CHUNKS, estimate="h100", mode="whole")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"name": "x", "peak_flops_fp32": ', encoding="utf-8")
    with pytest.raises(ProfileError, match=r"corrupt.json is not valid JSON \(line 1\)"):
        autopipe.profile(model, (x,), chunks=CHUNKS, estimate=corrupt)
    partial = tmp_path / "partial.json"
    data = load_sheet("h100").to_json()
    del data["launch_us"]
    partial.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ProfileError, match="lacks field 'launch_us'"):
        autopipe.profile(model, (x,), chunks=CHUNKS, estimate=str(partial))


def test_the_loss_is_counted_on_a_fake_output() -> None:
    with torch.device("meta"):
        model = nn.Linear(K, N)
    x, y = torch.randn(B, K), torch.randint(0, N, (B,))
    prof = autopipe.profile(model, (x,), chunks=CHUNKS, estimate=_compute_only(), progress=False,
                            loss_fn=nn.functional.cross_entropy, target=y)
    loss = prof.corrections.loss
    assert loss is not None and loss.micro_batch_size == M
    # cross-entropy keeps its log-softmax for the backward: M x N floats (and its one scalar)
    assert loss.held_bytes >= 4 * M * N and loss.peak_bytes >= loss.held_bytes


def test_every_micro_batch_size_is_estimated_at_its_own_rows(chain) -> None:
    model, x, _ = chain
    prof = autopipe.profile(model, (x,), chunks=CHUNKS, estimate=_compute_only(), micro_batch_sizes=[2],
                            progress=False)
    assert prof.meta["micro_batch_sizes"] == [2, M]
    first = prof.df.set_index("layer").loc["0"]
    assert first["saved_bytes@2"] == 4 * 2 * K and first["saved_bytes"] == 4 * M * K
    assert first["fwd_ms@2"] == pytest.approx(_ms(2 * 2 * K * N), abs=1e-6)


def test_hf_llama_whose_rotary_product_is_sampled_checkpointed_is_estimated() -> None:
    # the recompute sampler times its heaviest layers under a reentrant checkpoint; FlopCounterMode's
    # module hooks asserted there on HF Llama's rotary product (mul_5) at this size, which is
    # why the test takes seconds: a smaller model samples other layers
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 4096, (16, 32))
    prof = autopipe.profile(model, (), example_kwargs={"input_ids": x}, chunks=4, estimate="h100", progress=False)
    assert prof.meta["estimated"]["name"] == "h100" and (prof.df["fwd_ms"] > 0).all()
