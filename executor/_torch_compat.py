"""Every private torch API autopipe uses, in one place, each checked before it is relied on.

[Note: private torch API] pyproject admits torch 2.11 to 2.15 (the full suite runs on 2.13,
.ci/compat's subset on 2.11 and 2.15), and private names change between releases without notice. So no module imports a private torch
name directly: it imports it from here, where

- ``torch.utils._pytree`` (tree_flatten & co.), ``torch.nn.modules.batchnorm._BatchNorm`` and
  ``torch._subclasses.fake_tensor.FakeTensorMode`` are re-exported: they have kept their names
  and signatures since torch 2.0 and are what torch's own public wrappers use; an ImportError
  here names this module, not a deep frame of the tracer or the runtime;
- the receive-ahead GPipe schedule ([Note: receive ahead] in executor/ranks/prefetch.py) overrides
  ``ScheduleGPipe._step_microbatches`` and calls private schedule and stage methods.
  :func:`prefetch_support` checks each of their signatures against the two APIs the override
  was written for: torch 2.13's (``PREFETCH_SIGNATURES``, 2.15's too) and 2.11's, which
  lacks ``loss_kwargs`` (:func:`initialize_stage` and :func:`maybe_compute_loss` pass it where
  the schedule takes it); where torch's stage drops what a finished send held
  (``release_fwd_send_outputs``, 2.15) the override does so too (:func:`release_fwd_send`).
  On any other difference the executor runs torch's public ``ScheduleGPipe`` instead and
  warns once, in one line, saying why;
- :func:`without_self_sends` filters what ``PipelineStage._get_init_p2p_neighbors_ops`` gives,
  which executor/ranks/sized.py's stage overrides: torch 2.11 and 2.12 warm up the links to both
  neighbour stages at a schedule's first step, and under the V schedules (zbv, dualpipev) the
  two middle stages share a rank, so half of that is a send to the rank itself, which gloo
  refuses; torch 2.13 warms up another way and never calls the method for a PipelineStage
  (nor does any torch without it);
- :func:`symbol_source` names a symbolic size for fake tensors (``torch._dynamo.source``,
  which torch.export itself uses): only where a fake run at symbolic sizes is tried, which
  falls back to fixed sizes on any error;
- :func:`fake_dispatch_cache_off` turns the fake-tensor dispatch cache off while a FakeTensorMode
  is made inside a call that makes its own (torch.export's dynamic export): the mode reads
  ``torch._dynamo.config.fake_tensor_cache_enabled`` when it is made (2.11 to 2.15); without
  that switch it changes nothing;
- :func:`is_communication_error` tells a dead or silent peer from this rank's own error:
  by exception type where torch has the ``DistError`` classes, else by the messages gloo and
  NCCL put on a plain RuntimeError;
- :func:`mesh_group_options` gives a DeviceMesh dimension's process groups a timeout:
  ``init_device_mesh(backend_override=...)`` takes backend options and reads their
  ``_timeout`` (torch's own code does); for other backends than gloo and NCCL it gives None,
  the default timeout, and the pipeline's watchdog still ends a hung step;
- :func:`set_group_timeout` shortens a process group's timeout after a pipeline's first step
  ([Note: the first step's own limit] in executor/ranks/watchdog.py) through
  ``torch.distributed.distributed_c10d._set_pg_timeout``, as torchtitan does; where it is
  missing or refuses, it says so and the watchdog alone bounds later steps;
- :func:`found_inf_per_device` is ``torch.amp.GradScaler._found_inf_per_device``, the flags
  ``unscale_`` leaves and ``step`` / ``update`` read (torch's fused optimizers read them too),
  for executor/ranks/grad_scaler.py ([Note: loss scaling on ranks]); missing, it says so in one line;
- :func:`split_backward_api` is ``torch.distributed.pipelining._backward``'s
  ``stage_backward_input`` and ``stage_backward_weight``, the two halves of a backward that the
  zero-bubble schedules run, checked by signature; the profiler times each layer's backward
  with them ([Note: split backward measured] in autopipe/frontend/profiling/harness/backward_split.py),
  and where they differ it measures no split (the planner then refuses those schedules);
- :func:`merge_adjacent_backward` rewrites a zero-bubble schedule's compute order
  (``pipeline_order``, its ``_Action`` tuples) with executor.spec.merged_backward's rule and
  lowers it again with ``_prepare_schedule_with_comms``, as torch's own ``_load_csv`` does;
  where either is missing (or the order holds what the rule does not know) it leaves torch's
  order and says so once ([Note: adjacent I and W] in executor/spec.py).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import (
    TreeSpec,
    tree_flatten,
    tree_leaves,
    tree_map_only,
    tree_unflatten,
)

__all__ = [
    "BatchNormBase",
    "FakeTensorMode",
    "TreeSpec",
    "tree_flatten",
    "tree_leaves",
    "tree_map_only",
    "tree_unflatten",
    "prefetch_support",
    "prefetch_api",
    "initialize_stage",
    "maybe_compute_loss",
    "release_fwd_send",
    "warn_no_prefetch",
    "sorted_batch_p2p",
    "wait_batch_p2p",
    "without_self_sends",
    "is_communication_error",
    "symbol_source",
    "fake_dispatch_cache_off",
    "mesh_group_options",
    "set_group_timeout",
    "found_inf_per_device",
    "split_backward_api",
]

BatchNormBase = _BatchNorm


def symbol_source(name: str) -> Any:
    """A name for a symbolic size (``torch._dynamo.source.ConstantSource``), as fake tensors with
    symbolic sizes need one (executor/ranks/symbolic.py); imported here, lazily: dynamo is heavy."""
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)


def fake_dispatch_cache_off() -> contextlib.AbstractContextManager[Any]:
    """A context in which new FakeTensorModes have no dispatch cache (restored on exit)."""
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "fake_tensor_cache_enabled"):
        return contextlib.nullcontext()
    return dynamo_config.patch(fake_tensor_cache_enabled=False)  # type: ignore[no-any-return]


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
_COMMUNICATION_MARKERS = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout caused pair closure",  # gloo, a send or receive waited past the group's timeout
)


def is_communication_error(err: BaseException) -> bool:
    """True for a failure of the link to a peer (dead, silent or dropped); False for this
    rank's own errors (a shape mismatch, out of memory), which must propagate unchanged."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    text = str(err).lower()
    return any(marker in text for marker in _COMMUNICATION_MARKERS)


def mesh_group_options(backend: str, timeout: datetime.timedelta) -> Any:
    """Options giving a DeviceMesh dimension's groups ``timeout`` (see the module's docstring)."""
    kinds = {"nccl": dist.is_nccl_available, "gloo": dist.is_gloo_available}
    if backend not in kinds or not kinds[backend]():
        return None
    kind: Any = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
    try:
        try:
            options = kind.Options()
        except TypeError:  # gloo's is torch's Backend.Options(backend, timeout=...)
            options = kind.Options(backend)
        options._timeout = timeout
    except (AttributeError, TypeError):
        return None
    return options


def set_group_timeout(group: dist.ProcessGroup, timeout: datetime.timedelta) -> bool:
    """Set ``group``'s timeout for its later operations; False where this torch cannot."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "only supported for nccl or gloo": False below
            _set_pg_timeout(timeout, group)
    except (RuntimeError, ValueError, AssertionError, AttributeError, TypeError):
        return False
    return True


def found_inf_per_device(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                         ) -> dict[torch.device, torch.Tensor]:
    """The scaler's found-inf flag per device for ``optimizer`` since its ``unscale_`` (the
    dict itself: what is changed or added in it, ``step`` and ``update`` read)."""
    method = getattr(scaler, "_found_inf_per_device", None)
    if method is None:
        raise RuntimeError(f"torch {torch.__version__}'s GradScaler has no _found_inf_per_device: "
                           "executor.ranks.grad_scaler needs torch 2.11 to 2.15")
    found: dict[torch.device, torch.Tensor] = method(optimizer)
    return found


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
