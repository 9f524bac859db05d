"""Mixed precision through autopipe.pipeline and distributed_pipeline: HF Llama on 3 CPU stages
under the caller's bf16 autocast with every micro-batch recomputed (the bug a user hit:
recomputation replayed without autocast), ``precision="bf16"``, and a tied GPT on 2 gloo ranks
(a pipeline) and as 2 replicas (FSDP2's MixedPrecisionPolicy) against one process."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

import autopipe
from autopipe.assemble.ranks import distributed_pipeline
from autopipe.assemble.setup import microbatch_inputs
from autopipe.core.plan import Plan
from autopipe.errors import BuildError
from autopipe.examples import TinyGPT
from autopipe.frontend.tracing.graph import trace
from executor.ranks.distributed import DistributedError, DistributedPipeline
from tests.assemble.test_local import cost_profile
from tests.assemble.test_ranks import _ok, one_rank, spawn  # noqa: F401 - a fixture

CHUNKS = 4
BF16 = torch.bfloat16


def _llama() -> tuple[nn.Module, Tensor, Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      use_cache=False)
    return LlamaForCausalLM(cfg), torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))


def _lm_loss(out: Any, y: Tensor) -> Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _close(actual: Tensor, expected: Tensor, what: str, tol: float = 3e-2) -> None:
    """Equal at bf16's tolerance, relative to the largest value (see tests/executor/test_precision.py)."""
    scale = expected.abs().max().item() + 1e-6
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


Call = tuple[int, bool, torch.dtype, frozenset[torch.dtype]]


def record_calls(stages: Sequence[nn.Module]) -> list[Call]:
    """Every call of ``stages`` from now on (recomputations too), seen from inside it: the
    stage's index, whether autocast was on for the CPU, its dtype, and the floating dtypes of
    what the stage returned (a cut's activations, or the last stage's output): proof that a run
    compared to bf16's tolerance did compute in bf16, not in fp32 (which would pass it too)."""
    calls: list[Call] = []
    for j, stage in enumerate(stages):
        def hook(module: nn.Module, args: Any, out: Any, j: int = j) -> None:
            dtypes = frozenset(t.dtype for t in tree_leaves(out) if isinstance(t, Tensor) and t.is_floating_point())
            calls.append((j, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), dtypes))

        stage.register_forward_hook(hook)
    return calls


def assert_ran_in_bf16(calls: list[Call], stages: Sequence[int], chunks: int, cut: bool = True) -> None:
    """Each of ``stages`` ran ``chunks`` micro-batches (at least) and no other stage ran, every
    call under bf16 autocast; with ``cut``, some activation left a stage in bf16 (autocast's own
    output)."""
    assert all(sum(c[0] == j for c in calls) >= chunks for j in stages), calls
    assert {c[0] for c in calls} == set(stages), calls
    assert all(on and dtype == BF16 for _, on, dtype, _ in calls), calls
    assert not cut or BF16 in frozenset().union(*(c[3] for c in calls)), calls


def _reference(model: nn.Module, inputs: tuple[Tensor, ...], target: Tensor, chunks: int = CHUNKS
               ) -> Tensor:
    """The plain model under bf16 autocast, the mean loss over the same micro-batches."""
    xs, ys = [x.tensor_split(chunks) for x in inputs], target.tensor_split(chunks)
    with torch.autocast("cpu", dtype=BF16):
        loss = torch.stack([_lm_loss(model(*[x[i] for x in xs]), ys[i]) for i in range(chunks)]).mean()
    loss.backward()
    return loss.detach()


@pytest.fixture(scope="module")
def llama() -> dict[str, Any]:
    """One traced Llama for every case (tracing it is the slow part), and the plain model's
    logits, loss and gradients under bf16 autocast on the same micro-batches."""
    model, ids, target = _llama()
    ref = copy.deepcopy(model)
    graph = trace(model, microbatch_inputs((ids,), CHUNKS))
    with torch.autocast("cpu", dtype=BF16):
        logits = torch.cat([ref(x).logits for x in ids.tensor_split(CHUNKS)]).detach()
    loss = _reference(ref, (ids,), target)  # mean of equal micro-batches' means: the whole batch's
    return {"model": model, "ids": ids, "target": target, "graph": graph, "logits": logits,
            "loss": loss, "grads": {n: p.grad for n, p in ref.named_parameters()}}


@pytest.mark.parametrize(("how", "threads"), [("caller", False), ("caller", True), ("precision", True)])
def test_llama_recomputed_under_bf16_equals_the_plain_model(llama: dict[str, Any], how: str,
                                                            threads: bool) -> None:
    model, ids, target, graph = llama["model"], llama["ids"], llama["target"], llama["graph"]
    model.zero_grad(set_to_none=True)
    pipe = autopipe.pipeline(model, (ids,), devices=["cpu"] * 3, chunks=CHUNKS, recompute="always",
                             graph=graph, profile=cost_profile(graph),
                             precision="bf16" if how == "precision" else "fp32")
    pipe.threads = threads  # stages on worker threads, as on distinct devices
    calls = record_calls(pipe.stages)
    with torch.autocast("cpu", dtype=BF16, enabled=how == "caller"):
        out = pipe(ids)
    assert out.logits.dtype == BF16
    assert_ran_in_bf16(calls, range(3), CHUNKS)
    del calls[:]
    _close(out.logits, llama["logits"], "logits")
    with torch.autocast("cpu", dtype=BF16):
        loss = _lm_loss(out, target)
    _close(loss.detach(), llama["loss"], "loss")
    loss.backward()  # outside the autocast: every micro-batch is recomputed here
    assert_ran_in_bf16(calls, range(3), CHUNKS)  # ... under the forward's autocast
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        _close(p.grad, llama["grads"][name], name)


def test_bad_precision_is_refused_in_one_line() -> None:
    model, ids, _ = _llama()
    with pytest.raises(BuildError, match=r"^precision='half' is unknown; use one of fp32, bf16, fp16$"):
        autopipe.pipeline(model, (ids,), devices=["cpu"] * 2, precision="half")


@pytest.mark.usefixtures("one_rank")
def test_bad_precision_on_ranks_is_one_line() -> None:
    model, ids, _ = _llama()
    with pytest.raises(BuildError, match=r"^precision='int8' is unknown; use one of fp32, bf16, fp16$"):
        distributed_pipeline(model, (ids,), loss_fn=_lm_loss, precision="int8")
    with pytest.raises(DistributedError, match=r"^precision=None is unknown"):
        DistributedPipeline([nn.Identity()], [0], 1, loss_fn=_lm_loss, wires=[(), ()],
                            precision=None)  # type: ignore[arg-type]


# --- on ranks ---------------------------------------------------------------------------------
def _gpt() -> tuple[nn.Module, Tensor, Tensor]:
    """A GPT whose head is tied to its embedding (the tie spans both ranks)."""
    torch.manual_seed(0)
    return TinyGPT(vocab=16, dim=8, heads=2, layers=1, max_len=4), \
        torch.randint(0, 16, (8, 4)), torch.randint(0, 16, (8, 4))


def _plan(model: nn.Module, ids: Tensor, recompute: str, data_parallel: int = 1) -> Plan:
    """Two stages cut after ``blocks.0.fc1`` (its bf16 output crosses beside the fp32 residual),
    or one stage for ``data_parallel`` FSDP replicas."""
    graph = trace(model, microbatch_inputs((ids,), CHUNKS))
    prof = cost_profile(graph)
    at = graph.layers.index("blocks.0.fc1") + 1
    stages = [graph.layers[:at], graph.layers[at:]] if data_parallel == 1 else [graph.layers]
    plan = Plan.from_stages(prof, stages, chunks=CHUNKS)
    return dataclasses.replace(plan, recompute=recompute, data_parallel=data_parallel, dp_mode="fsdp")


def _two_ranks(rank: int) -> dict[str, Any]:
    """precision="bf16" with every micro-batch recomputed; the caller's autocast around step()
    (fp32 wires); then 2 FSDP2 replicas of the whole model in bf16."""
    out: dict[str, Any] = {}
    for name, precision, checkpoint in (("own", "bf16", "always"), ("caller", "fp32", "except_last")):
        model, ids, target = _gpt()
        pipe = distributed_pipeline(model, (ids,), loss_fn=_lm_loss, plan=_plan(model, ids, checkpoint),
                                    precision=precision, timeout=30)
        calls = record_calls(pipe.stages)
        with torch.autocast("cpu", dtype=BF16, enabled=precision == "fp32"):
            loss = pipe.step(ids, target=target)
        out[name] = {"loss": loss, "grads": {n: p.grad for n, p in pipe.stage_module.named_parameters()},
                     "wires": [w.dtype for s in pipe.wire_stages for w in s.outputs if w.kind == "tensor"],
                     "first": pipe.is_first, "calls": calls}
    model, ids, target = _gpt()
    x, y = ids.tensor_split(2)[rank], target.tensor_split(2)[rank]
    pipe = distributed_pipeline(model, (x,), loss_fn=_lm_loss, plan=_plan(model, x, "never", 2),
                                precision="bf16", timeout=30)
    seen: list[torch.dtype] = []  # after FSDP's own pre-forward hook has gathered them
    pipe.wire_stages[0].register_forward_pre_hook(
        lambda m, _: seen.append(next(m.stage.parameters()).dtype))
    loss = pipe.step(x, target=y)
    out["fsdp"] = {"loss": loss, "gathered": set(seen),
                   "grads": {n: p.grad.full_tensor() for n, p in pipe.stage_module.named_parameters()},
                   "masters": {p.dtype for p in pipe.stage_module.parameters()}}
    return out


@pytest.mark.slow
@pytest.mark.compat  # [Note: the last stage's dtype] on torch 2.11
@pytest.mark.timeout(90)
def test_two_ranks_under_bf16_equal_one_process() -> None:
    values = _ok(spawn(_two_ranks, timeout=75))
    for name in ("own", "caller"):
        model, ids, target = _gpt()
        ref_loss = _reference(model, (ids,), target)
        first, last = (values[0][name], values[1][name]) if values[0][name]["first"] else \
            (values[1][name], values[0][name])
        assert first["loss"] is None
        _close(last["loss"], ref_loss, f"{name} loss")
        # the pipeline's own precision probes its wires under autocast: fc1's output crosses in
        # bf16, the residual in fp32; under the caller's autocast alone all cross in fp32
        cut = first["wires"]
        assert set(cut) == ({BF16, torch.float32} if name == "own" else {torch.float32}), (name, cut)
        # ... and each rank's stage computed in bf16, fc1's output leaving the first in bf16
        assert_ran_in_bf16(first["calls"], [0], CHUNKS)
        assert_ran_in_bf16(last["calls"], [0], CHUNKS, cut=False)
        covered = set()
        for v in values:
            for n, grad in v[name]["grads"].items():
                assert grad.dtype == torch.float32
                _close(grad, model.get_parameter(n).grad, f"{name} {n}")
                covered.add(n)
        assert covered == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    # FSDP2: parameters gathered in bf16 for the forward, fp32 shards and gradients
    model, ids, target = _gpt()
    ref_loss = _reference(model, (ids,), target, chunks=2 * CHUNKS)
    fsdp = [v["fsdp"] for v in values]
    assert all(f["gathered"] == {BF16} and f["masters"] == {torch.float32} for f in fsdp)
    _close(torch.stack([f["loss"] for f in fsdp]).mean(), ref_loss, "fsdp loss")
    for n, p in model.named_parameters():
        assert all(f["grads"][n].dtype == torch.float32 for f in fsdp)
        _close(fsdp[0]["grads"][n], p.grad, f"fsdp {n}", tol=5e-2)
        torch.testing.assert_close(fsdp[0]["grads"][n], fsdp[1]["grads"][n])


# --- the plan is made for the pipeline's precision ------------------------------------------
def _mlp() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)), torch.randn(8, 16)


def test_pipeline_profiles_and_plans_under_its_precision() -> None:
    model, x = _mlp()
    pipe = autopipe.pipeline(model, (x,), devices=["cpu", "cpu"], chunks=2, precision="bf16")
    assert pipe.plan.precision == "bf16" and pipe.precision == "bf16"
    assert pipe(x).dtype == BF16


def test_a_plan_or_profile_of_another_precision_warns_in_one_line() -> None:
    model, x = _mlp()
    micro = microbatch_inputs((x,), 2)
    graph = trace(model, micro)
    prof = cost_profile(graph)  # fp32: no precision recorded
    with pytest.warns(UserWarning, match=r"^autopipe: the profile was measured under "
                      r"precision='fp32' but the pipeline computes in 'bf16'.*--precision bf16\)"):
        autopipe.pipeline(model, (x,), devices=["cpu", "cpu"], chunks=2, profile=prof, graph=graph,
                          precision="bf16")
    plan = autopipe.partition(prof, stages=2, chunks=2)
    with pytest.warns(UserWarning, match=r"^autopipe: the plan was measured under precision='fp32'"):
        autopipe.pipeline(model, (x,), devices=["cpu", "cpu"], plan=plan, graph=graph,
                          precision="bf16")
