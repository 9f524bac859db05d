"""[Note: tokens over replicas] (executor/ranks/replicated.py): 2 replicas x 2 stages of an HF
Llama that computes its own loss, each replica given its half of a batch whose padding and ignored
labels fall unevenly on the halves. Under DDP and FSDP2 every replica reports the one-process
loss of the whole batch, and the gradients are the one-process ones, not the mean of the
replicas' own token-weighted losses. The same for a batch of twice the rows in two steps,
accumulated under ``num_items_in_batch`` (all of its items, as HuggingFace's Trainer passes them)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import autopipe
from tests.assemble.test_hf_batches import _llama, causal_batch
from tests.assemble.test_local import cost_profile

REPLICAS, CHUNKS = 2, 2


def _halves(batch: dict[str, torch.Tensor], replica: int) -> dict[str, torch.Tensor]:
    return {k: v.tensor_split(REPLICAS)[replica] for k, v in batch.items()}


def _on_replicas(rank: int, plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from autopipe.assemble.ranks import distributed_pipeline
    from autopipe.core.plan import Plan

    values = {}
    for mode, plan in plans.items():
        torch.manual_seed(0)
        model = _llama()
        batch = causal_batch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = distributed_pipeline(model, example_kwargs=_halves(batch, 0), chunks=CHUNKS,
                                        plan=Plan.from_dict(plan), timeout=30)
        loss = pipe.step(**_halves(batch, pipe.dp_rank))
        values[mode] = {"loss": loss, "grads": _grads(pipe), "replica": pipe.dp_rank}
        # a batch of twice the rows in two steps of this one's size, their gradients summed
        for p in pipe.stage_module.parameters():
            p.grad = None
        big = causal_batch(rows=2 * len(batch["labels"]))
        items = int((big["labels"][:, 1:] != -100).sum())
        parts = [pipe.step(**_halves({k: v.tensor_split(2)[i] for k, v in big.items()}, pipe.dp_rank),
                           num_items_in_batch=items) for i in range(2)]
        values[mode]["accumulated"] = {"loss": None if parts[0] is None else parts[0] + parts[1],
                                       "grads": _grads(pipe)}
    return values


def _grads(pipe: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in pipe.stage_module.named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_replicas_weigh_the_models_loss_by_the_whole_batchs_tokens() -> None:
    from tests.assemble.test_ranks import _ok, spawn

    torch.manual_seed(0)
    model = _llama()
    reference = copy.deepcopy(model)
    batch = causal_batch()
    counts = [int((h["labels"][:, 1:] != -100).sum()) for h in (_halves(batch, r) for r in range(REPLICAS))]
    assert counts[0] != counts[1]  # the halves count unequal tokens: the mean of their losses is wrong
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = autopipe.trace(model, (), example_kwargs={k: v[:2] for k, v in batch.items()})
    plans = {mode: autopipe.partition(cost_profile(graph), stages=2, chunks=CHUNKS, data_parallel=REPLICAS,
                                      dp_mode=mode).to_dict() for mode in ("ddp", "fsdp")}
    values = _ok(spawn(_on_replicas, plans, world=4, timeout=190))
    twice = copy.deepcopy(reference)  # the plain model on the batch the accumulated steps split
    expected_twice = twice(**causal_batch(rows=2 * len(batch["labels"])))
    expected_twice.loss.backward()
    expected = reference(**batch)
    expected.loss.backward()
    with torch.no_grad():  # what the replicas reported before: the mean of their own losses
        own = [float(model(**_halves(batch, r)).loss) for r in range(REPLICAS)]
    assert abs(sum(own) / REPLICAS - float(expected.loss)) > 1e-3  # differs from the whole batch's
    for mode in ("ddp", "fsdp"):
        for run, truth, plain in (("whole", expected, reference), ("accumulated", expected_twice, twice)):
            covered = set()
            for rank, v in enumerate(values):
                mine = v[mode] if run == "whole" else v[mode]["accumulated"]
                if mine["loss"] is not None:  # each replica's last stage: the whole batch's loss
                    assert_close(mine["loss"], truth.loss.detach(), msg=f"{mode} {run}: rank {rank}")
                for name, grad in mine["grads"].items():
                    assert_close(grad, plain.get_parameter(name).grad, msg=f"{mode} {run}: rank {rank} {name}")
                    covered.add(name)
            assert covered == {n for n, _ in reference.named_parameters()}, (mode, run)
        assert sum(v[mode]["loss"] is not None for v in values) == REPLICAS, mode

