"""executor._torch_compat: the private torch API the runtime relies on, and its fallbacks.

The receive-ahead schedule's numerics are covered by tests/assemble/test_ranks.py, whose "gpipe"
runs use it (and one run forced onto the fallback) and compare loss and every gradient with one
process. Here: the signature checks that decide between the two, on the real torch and on a
torch whose private methods drifted.
"""

from __future__ import annotations

import inspect
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import executor._torch_compat.schedules as compat
import executor.ranks.distributed as distributed
import executor.ranks.torch_schedules as torch_schedules
from executor._torch_compat import groups
from executor.errors import DistributedError
from executor.ranks.prefetch import PrefetchGPipe

pytestmark = pytest.mark.compat  # .ci/compat runs these on every supported torch


def test_this_torch_has_what_the_receive_ahead_schedule_needs() -> None:
    assert compat.prefetch_support() is None
    api = compat.prefetch_api()
    assert api == ("2.11" if torch_version() < (2, 13) else "2.13")
    assert distributed.schedule_class("gpipe") is PrefetchGPipe
    # The override takes every parameter of the method it replaces, in order (loss_kwargs,
    # torch 2.13's, comes last and stays None on an older torch, whose step() never passes it).
    ours = tuple(inspect.signature(PrefetchGPipe._step_microbatches).parameters)
    theirs = tuple(inspect.signature(ScheduleGPipe._step_microbatches).parameters)
    assert ours[:len(theirs)] == theirs and ours[len(theirs):] in ((), ("loss_kwargs",))
    # Every method the override calls is checked, and the check reads the real classes.
    for (cls_name, name), expected in compat.PREFETCH_APIS[api].items():
        cls = {"ScheduleGPipe": ScheduleGPipe, "PipelineStage": PipelineStage}[cls_name]
        params = tuple(inspect.signature(getattr(cls, name)).parameters)[1:]
        assert params == expected, (cls_name, name)
    source = "".join(inspect.getsource(fn) for fn in (
        PrefetchGPipe._step_microbatches, compat.initialize_stage, compat.maybe_compute_loss))
    called = {name for _, name in compat.PREFETCH_SIGNATURES if f".{name}(" in source}
    assert called >= {"_check_inputs", "_initialize_stage", "_maybe_compute_loss", "_maybe_get_loss",
                      "_update_losses", "forward_one_chunk", "backward_one_chunk",
                      "perform_reduce_grad", "get_fwd_recv_ops", "get_bwd_send_ops"}
    # torch 2.15's stage drops what a finished forward send held; the override lets it.
    assert hasattr(PipelineStage, "release_fwd_send_outputs") == (torch_version() >= (2, 15))


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("api", ["2.13", "2.11"])
def test_each_known_api_is_recognised_and_called_as_it_was_written(
        api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, tuple[object, ...]]] = []
    params = compat.PREFETCH_APIS[api]

    def method(cls_name: str, name: str) -> object:
        def fn(self: object, *args: object) -> None:
            calls.append((name, args))
        names = ("self", *params[(cls_name, name)])
        fn.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
        return fn

    classes = {c: type(c, (), {n: method(c, n) for (k, n) in params if k == c})
               for c in ("ScheduleGPipe", "PipelineStage")}
    ns = types.SimpleNamespace(**classes)
    assert compat.prefetch_api(ns) == api
    assert compat.prefetch_support(namespace=ns) is None
    schedule = object.__new__(classes["ScheduleGPipe"])
    monkeypatch.setattr(compat, "_this_api", lambda: api)
    compat.initialize_stage(schedule, "args", "kwargs", "target", {"k": 1})
    compat.maybe_compute_loss(schedule, "stage", "out", ["t"], 3, {"k": 1})
    if api == "2.11":
        assert calls == [("_initialize_stage", ("args", "kwargs")),
                         ("_maybe_compute_loss", ("stage", "out", ["t"], 3))]
    else:
        assert calls == [("_initialize_stage", ("args", "kwargs", "target", {"k": 1})),
                         ("_maybe_compute_loss", ("stage", "out", ["t"], 3, {"k": 1}))]


def test_release_of_finished_sends_is_called_where_the_stage_has_it() -> None:
    released: list[int] = []
    compat.release_fwd_send(types.SimpleNamespace(release_fwd_send_outputs=released.append), 2)
    compat.release_fwd_send(types.SimpleNamespace(), 3)  # before torch 2.15: nothing to call
    assert released == [2]


def _drifted_namespace() -> types.SimpleNamespace:
    class Schedule(ScheduleGPipe):
        def _initialize_stage(self, args, kwargs, target=None, loss_kwargs=None, extra=0):  # type: ignore[no-untyped-def]
            raise AssertionError("never called")

    class Missing:
        pass

    return types.SimpleNamespace(ScheduleGPipe=Schedule, PipelineStage=Missing)


def test_a_drifted_private_signature_is_named() -> None:
    ns = _drifted_namespace()
    # the drifted class inherits the rest from this torch's ScheduleGPipe, whichever API it has
    problem = compat.prefetch_support(compat.PREFETCH_APIS[str(compat.prefetch_api())], namespace=ns)
    assert problem is not None and problem.startswith("ScheduleGPipe._initialize_stage(")
    assert "'extra'" in problem and "differs from the expected" in problem
    only_stage = {k: v for k, v in compat.PREFETCH_SIGNATURES.items() if k[0] == "PipelineStage"}
    assert compat.prefetch_support(only_stage, namespace=ns) == "PipelineStage.get_fwd_recv_ops is missing"


def test_gpipe_falls_back_to_torch_schedule_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_schedules, "prefetch_support", lambda: "ScheduleGPipe.x is missing")
    monkeypatch.setattr(compat, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"ScheduleGPipe.x is missing; autopipe runs "
                                            r"schedule='gpipe' on torch's ScheduleGPipe") as record:
        assert distributed.schedule_class("gpipe") is ScheduleGPipe
    assert len(record) == 1 and "\n" not in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not at every pipeline built
        assert distributed.schedule_class("gpipe") is ScheduleGPipe
    assert distributed.schedule_class("1f1b").__name__ == "Schedule1F1B"  # untouched
    with pytest.raises(DistributedError, match="schedule='zb' is unknown; use one of"):
        distributed.schedule_class("zb")


@pytest.mark.parametrize(("error", "expected"), [
    (dist.DistNetworkError("anything"), True),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"), True),
    (RuntimeError("Timed out waiting 20000ms for recv operation to complete"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x2)"), False),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("expected a peer-to-peer friendly layout"), False),
])
def test_communication_errors_are_told_from_a_ranks_own(error: BaseException, expected: bool) -> None:
    assert groups.is_communication_error(error) is expected
