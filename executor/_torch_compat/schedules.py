"""Private torch.distributed.pipelining API: the receive-ahead GPipe, split backward, merged orders.

One part of executor._torch_compat: see [Note: private torch API] in its __init__.py.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PREFETCH_SIGNATURES", "PREFETCH_SIGNATURES_2_11", "PREFETCH_APIS", "prefetch_support", "prefetch_api", "initialize_stage", "maybe_compute_loss", "release_fwd_send", "warn_no_prefetch", "sorted_batch_p2p", "wait_batch_p2p", "without_self_sends", "split_backward_api", "merge_adjacent_backward"]

# The parameters (after self) of each private method the receive-ahead schedule overrides or
# calls, as in torch 2.13. Exact names and order: a renamed or inserted parameter means the
# override would call it wrongly, so the schedule falls back to ScheduleGPipe. Classes are
# named, not imported: torch.distributed.pipelining is imported only when a check runs.
PREFETCH_SIGNATURES: dict[tuple[str, str], tuple[str, ...]] = {
    ("ScheduleGPipe", "__init__"): ("stage", "n_microbatches", "loss_fn", "args_chunk_spec",
                                  "kwargs_chunk_spec", "output_merge_spec", "scale_grads"),
    ("ScheduleGPipe", "_step_microbatches"): ("arg_mbs", "kwarg_mbs", "target_mbs", "losses",
                                            "return_outputs", "loss_kwargs"),
    ("ScheduleGPipe", "_check_inputs"): ("arg_mbs", "kwarg_mbs", "target_mbs", "losses"),
    ("ScheduleGPipe", "_initialize_stage"): ("args", "kwargs", "target", "loss_kwargs"),
    ("ScheduleGPipe", "_maybe_compute_loss"): ("stage", "output", "target_mbs", "mb_index",
                                             "loss_kwargs"),
    ("ScheduleGPipe", "_maybe_get_loss"): ("stage", "mb_index"),
    ("ScheduleGPipe", "_update_losses"): ("stages", "losses"),
    ("PipelineStage", "get_fwd_recv_ops"): ("fwd_chunk_id",),
    ("PipelineStage", "get_fwd_send_ops"): ("fwd_chunk_id",),
    ("PipelineStage", "get_bwd_recv_ops"): ("bwd_chunk_id",),
    ("PipelineStage", "get_bwd_send_ops"): ("bwd_chunk_id",),
    ("PipelineStage", "forward_one_chunk"): ("fwd_chunk_id", "args", "kwargs",
                                           "save_forward_output"),
    ("PipelineStage", "backward_one_chunk"): ("bwd_chunk_id", "loss", "full_backward",
                                            "last_backward"),
    ("PipelineStage", "perform_reduce_grad"): ("grad_scale_factor",),
}
# torch 2.11 and 2.12: the same methods before 2.13 added ``loss_kwargs`` (and the first
# target to ``_initialize_stage``).
PREFETCH_SIGNATURES_2_11: dict[tuple[str, str], tuple[str, ...]] = {
    **PREFETCH_SIGNATURES,
    ("ScheduleGPipe", "_step_microbatches"): ("arg_mbs", "kwarg_mbs", "target_mbs", "losses",
                                            "return_outputs"),
    ("ScheduleGPipe", "_initialize_stage"): ("args", "kwargs"),
    ("ScheduleGPipe", "_maybe_compute_loss"): ("stage", "output", "target_mbs", "mb_index"),
}
# Each API the override runs on, by the first torch release that has it, newest first.
PREFETCH_APIS: dict[str, dict[tuple[str, str], tuple[str, ...]]] = {
    "2.13": PREFETCH_SIGNATURES,
    "2.11": PREFETCH_SIGNATURES_2_11,
}
# Called where it exists (torch 2.15 on), with this signature.
_RELEASE_SIGNATURE = ("PipelineStage", "release_fwd_send_outputs"), ("fwd_chunk_id",)
_HELPER_SIGNATURES: dict[str, tuple[str, ...]] = {
    "_sorted_batch_p2p": ("p2p_ops", "desc"),
    "_wait_batch_p2p": ("work",),
}


def _parameters(fn: Callable[..., Any], *, method: bool) -> tuple[str, ...]:
    names = tuple(inspect.signature(fn).parameters)
    return names[1:] if method else names


def _load_helpers() -> tuple[dict[str, Callable[..., Any]], str | None]:
    from torch.distributed.pipelining import schedules

    helpers = {name: getattr(schedules, name, None) for name in _HELPER_SIGNATURES}
    for name, expected in _HELPER_SIGNATURES.items():
        fn = helpers[name]
        if fn is None:
            return {}, f"torch.distributed.pipelining.schedules.{name} is missing"
        found = _parameters(fn, method=False)
        if found != expected:
            return {}, f"schedules.{name}{found} differs from the expected {expected}"
    return {k: v for k, v in helpers.items() if v is not None}, None


@functools.cache
def _helpers() -> tuple[dict[str, Callable[..., Any]], str | None]:
    return _load_helpers()


def _check(signatures: dict[tuple[str, str], tuple[str, ...]], namespace: Any) -> str | None:
    for (cls_name, name), expected in signatures.items():
        fn = getattr(getattr(namespace, cls_name, None), name, None)
        if fn is None:
            return f"{cls_name}.{name} is missing"
        found = _parameters(fn, method=True)
        if found != expected:
            return f"{cls_name}.{name}{found} differs from the expected {expected}"
    (cls_name, name), expected = _RELEASE_SIGNATURE
    release = getattr(getattr(namespace, cls_name, None), name, None)
    if release is not None and _parameters(release, method=True) != expected:
        return f"{cls_name}.{name}{_parameters(release, method=True)} differs from the expected {expected}"
    return None


def prefetch_api(namespace: Any = None) -> str | None:
    """Which of ``PREFETCH_APIS`` this torch has ("2.13", "2.11"), None where neither.
    ``namespace`` (default torch.distributed.pipelining) is where the classes are looked up."""
    if namespace is None:
        return _this_api()
    if _helpers()[1] is not None:
        return None
    return next((api for api, sigs in PREFETCH_APIS.items() if _check(sigs, namespace) is None),
                None)


@functools.cache
def _this_api() -> str | None:
    import torch.distributed.pipelining as namespace

    return prefetch_api(namespace)


def prefetch_support(
    signatures: dict[tuple[str, str], tuple[str, ...]] | None = None,
    namespace: Any = None,
) -> str | None:
    """None when this torch has every private piece the receive-ahead schedule needs, with the
    signatures of one of ``PREFETCH_APIS`` (or exactly ``signatures``); else one line saying
    what differs from the newest. ``namespace`` (default torch.distributed.pipelining) is
    where the classes are looked up."""
    if namespace is None:
        import torch.distributed.pipelining as namespace
    _, problem = _helpers()
    if problem is not None:
        return problem
    if signatures is not None:
        return _check(signatures, namespace)
    problems = [_check(sigs, namespace) for sigs in PREFETCH_APIS.values()]
    return None if None in problems else problems[0]


def initialize_stage(schedule: Any, args: Any, kwargs: Any, target: Any, loss_kwargs: Any) -> None:
    """``schedule._initialize_stage``, given the first target and ``loss_kwargs`` where it
    takes them (torch 2.13 on)."""
    if _this_api() == "2.11":
        schedule._initialize_stage(args, kwargs)
    else:
        schedule._initialize_stage(args, kwargs, target, loss_kwargs)


def maybe_compute_loss(schedule: Any, stage: Any, output: Any, target_mbs: Any, index: int,
                       loss_kwargs: Any) -> None:
    """``schedule._maybe_compute_loss``, given ``loss_kwargs`` where it takes them (2.13 on)."""
    if _this_api() == "2.11":
        schedule._maybe_compute_loss(stage, output, target_mbs, index)
    else:
        schedule._maybe_compute_loss(stage, output, target_mbs, index, loss_kwargs)


def release_fwd_send(stage: Any, index: int) -> None:
    """Once micro-batch ``index``'s forward sends are done, let the stage drop what they held,
    as torch's own ScheduleGPipe does where the stage can (2.15 on); nothing before."""
    release = getattr(stage, _RELEASE_SIGNATURE[0][1], None)
    if release is not None:
        release(index)


_warned: set[str] = set()


def warn_no_prefetch(reason: str) -> None:
    """Say once per reason that GPipe runs on torch's ScheduleGPipe, and why."""
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(
        f"torch {torch.__version__}: {reason}; autopipe runs schedule='gpipe' on torch's "
        "ScheduleGPipe (receives are not posted ahead: correct, possibly slower)",
        RuntimeWarning,
        stacklevel=3,
    )


def sorted_batch_p2p(ops: list[Any], desc: str) -> dict[int, list[Any]]:
    return _helpers()[0]["_sorted_batch_p2p"](ops, desc=desc)  # type: ignore[no-any-return]


def wait_batch_p2p(work: list[Any]) -> None:
    _helpers()[0]["_wait_batch_p2p"](work)


def without_self_sends(ops: list[Any], group_rank: int) -> list[Any]:
    """The P2POps of a stage's warm-up but those to ``group_rank`` itself (see the module doc)."""
    return [op for op in ops if getattr(op, "group_peer", None) != group_rank]


# Messages gloo and NCCL put on a plain RuntimeError when a peer dies, hangs or drops.
# torch 2.13's parameters of the two halves of a split backward
SPLIT_BACKWARD_SIGNATURES: dict[str, tuple[str, ...]] = {
    "stage_backward_input": ("stage_outputs_or_loss", "output_grads", "input_values", "weights"),
    "stage_backward_weight": ("weights", "param_groups", "retain_graph"),
}


@functools.cache
def split_backward_api() -> tuple[Callable[..., Any], Callable[..., Any]] | str:
    """(stage_backward_input, stage_backward_weight) as torch.distributed.pipelining's
    PipelineStage runs a zero-bubble schedule's I and W, or why they cannot be used here."""
    try:
        from torch.distributed.pipelining import _backward
    except ImportError as err:
        return f"torch.distributed.pipelining._backward does not import ({err})"
    found = []
    for name, expected in SPLIT_BACKWARD_SIGNATURES.items():
        fn = getattr(_backward, name, None)
        if fn is None or _parameters(fn, method=False) != expected:
            return f"torch {torch.__version__}'s {name} is not the one autopipe was written for"
        found.append(fn)
    return found[0], found[1]


_MERGE_WARNED: list[str] = []


def merge_adjacent_backward(schedule: Any, name: str, ranks: int, rule: str = "unwaited") -> str | None:
    """``schedule`` (a torch _PipelineScheduleRuntime of the zero-bubble schedule ``name`` on
    ``ranks`` ranks) with the I and W that executor.spec.merged_backward merges under ``rule``
    run as one whole backward ([Note: adjacent I and W] in executor/spec.py); None when done,
    else why not (warned once; torch's order is kept)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    from executor.spec import merged_backward

    types = getattr(torch_schedules, "_ComputationType", None)
    order = getattr(schedule, "pipeline_order", None)
    problem = None
    if types is None or not isinstance(order, dict) or not hasattr(schedule, "_prepare_schedule_with_comms"):
        problem = f"torch {torch.__version__}'s schedules lack pipeline_order or _prepare_schedule_with_comms"
    else:
        kinds = {types.FORWARD: "F", types.BACKWARD_INPUT: "I", types.BACKWARD_WEIGHT: "W",
                 types.FULL_BACKWARD: "B"}
        merged: dict[int, list[Any]] = {}
        for rank, actions in order.items():
            present = [a for a in actions if a is not None]
            ops = [(a.stage_index, kinds.get(a.computation_type, "other"), a.microbatch_index) for a in present]
            out, j = [], 0
            for op in merged_backward(ops, name, ranks, rule):
                if op[1] == "B" and ops[j][1] == "I":
                    out.append(present[j]._replace(computation_type=types.FULL_BACKWARD))
                    j += 2
                else:
                    out.append(present[j])
                    j += 1
            merged[rank] = out
        try:
            schedule._prepare_schedule_with_comms(merged)
            schedule.pipeline_order = merged
        except Exception as err:  # noqa: BLE001 - any refusal: torch's own order, said once
            schedule._prepare_schedule_with_comms(order)
            problem = f"torch {torch.__version__} refused the merged order ({str(err).splitlines()[0]})"
    if problem is not None and problem not in _MERGE_WARNED:
        _MERGE_WARNED.append(problem)
        warnings.warn(f"autopipe: the zero-bubble schedules run every backward split: {problem}; the "
                      "plan's prediction assumed some adjacent halves whole", stacklevel=3)
    return problem
