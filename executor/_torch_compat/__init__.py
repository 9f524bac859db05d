"""Every private torch API autopipe uses, in one place, each checked before it is relied on.

[Note: private torch API] pyproject admits torch 2.11 to 2.15 (the full suite runs on 2.13,
.ci/compat's subset on 2.11 and 2.15), and private names change between releases without notice. So no module imports a private torch
name directly: it imports it from here, where

- ``torch.utils._pytree`` (tree_flatten & co.), ``torch.nn.modules.batchnorm._BatchNorm``,
  ``torch._subclasses.fake_tensor.FakeTensorMode`` and ``torch.utils._python_dispatch.TorchDispatchMode``
  (executor/memory_meter.py's base) are re-exported: they have kept their names
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
- :class:`CompatStage` overrides seven private PipelineStage methods on torch 2.11 and 2.12,
  whose stage asks every received value for a gradient, integers too ([Note: integers across a
  cut]), and checks the last stage's output dtype against the traced one ([Note: the last
  stage's dtype]);
- :func:`merge_adjacent_backward` rewrites a zero-bubble schedule's compute order
  (``pipeline_order``, its ``_Action`` tuples) with executor.spec.merged_backward's rule and
  lowers it again with ``_prepare_schedule_with_comms``, as torch's own ``_load_csv`` does;
  where either is missing (or the order holds what the rule does not know) it leaves torch's
  order and says so once ([Note: adjacent I and W] in executor/spec.py).

Modules (every private torch import of the project is in one of them, tests/test_layering.py):
    tensors    pytree, FakeTensorMode, _BatchNorm, symbolic sizes, the fake-tensor cache
    schedules  torch.distributed.pipelining: the private schedule and stage methods of the
               receive-ahead GPipe, the split backward's halves, a zero-bubble order merged
    groups     process groups: timeouts, a peer's failure told from this rank's, the GradScaler's
               found-inf flags
    stages     a PipelineStage that runs on torch 2.11 as on 2.13 (gradients of floating values
               only; the last stage's dtype unchecked: [Note: integers across a cut])
"""

from __future__ import annotations

from executor._torch_compat.groups import (
    found_inf_per_device,
    is_communication_error,
    mesh_group_options,
    set_group_timeout,
)
from executor._torch_compat.schedules import (
    PREFETCH_APIS,
    PREFETCH_SIGNATURES,
    PREFETCH_SIGNATURES_2_11,
    initialize_stage,
    maybe_compute_loss,
    merge_adjacent_backward,
    prefetch_api,
    prefetch_support,
    release_fwd_send,
    sorted_batch_p2p,
    split_backward_api,
    wait_batch_p2p,
    warn_no_prefetch,
    without_self_sends,
)
from executor._torch_compat.stages import ASKS_EVERY_BUFFER, CompatStage
from executor._torch_compat.tensors import (
    BatchNormBase,
    FakeTensorMode,
    TorchDispatchMode,
    TreeSpec,
    fake_dispatch_cache_off,
    symbol_source,
    tree_flatten,
    tree_leaves,
    tree_map_only,
    tree_unflatten,
)

__all__ = [
    "BatchNormBase", "FakeTensorMode", "TorchDispatchMode", "TreeSpec", "tree_flatten", "tree_leaves", "tree_map_only",
    "tree_unflatten", "symbol_source", "fake_dispatch_cache_off",
    "PREFETCH_APIS", "PREFETCH_SIGNATURES", "PREFETCH_SIGNATURES_2_11", "prefetch_support",
    "prefetch_api", "initialize_stage", "maybe_compute_loss", "release_fwd_send", "warn_no_prefetch",
    "sorted_batch_p2p", "wait_batch_p2p", "without_self_sends", "split_backward_api",
    "merge_adjacent_backward",
    "is_communication_error", "mesh_group_options", "set_group_timeout", "found_inf_per_device",
    "ASKS_EVERY_BUFFER", "CompatStage",
]
