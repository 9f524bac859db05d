"""executor.GPipe against the unpipelined model: outputs, losses, gradients, optimizer steps."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from executor.errors import ExecutorError, MicroBatchError, PlacementError
from executor.local.gpipe import GPipe
from tests.conftest import skip_if_no_cuda
from tests.models import Chain, Dropouty, MultiIO, Skip

MODES = ["always", "except_last", "never"]


class Steps(nn.Module):
    """A stage made of consecutive steps of a model, holding its submodules by their names.

    ``steps`` are functions ``(owner, *args) -> out``; the stage keeps the original model's
    submodules as attributes, so its state_dict keys equal the model's.
    """

    def __init__(self, model: nn.Module, names: Sequence[str], steps: Sequence[Callable[..., Any]]):
        super().__init__()
        for name in names:
            setattr(self, name, getattr(model, name))
        self.steps = list(steps)

    def forward(self, *args: Any) -> Any:
        out: Any = args
        for k, step in enumerate(self.steps):
            out = step(self, *out) if k == 0 or isinstance(out, tuple) else step(self, out)
        return out


def _group(k: int, n: int) -> list[list[int]]:
    """Split steps 0..n-1 into k consecutive non-empty groups."""
    bounds = [round(n * s / k) for s in range(k + 1)]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(k)]


# Skip: h = a(x); y = c(relu(b(h))); out = d(y + h). The skip h and an int ride along as a
# tuple through the middle stages; the int must arrive unchanged.
def _skip_a(m: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, int]:
    h = m.a(x)
    return h, h, 2


def _skip_b(m: nn.Module, y: Tensor, h: Tensor, n: int) -> tuple[Tensor, Tensor, int]:
    return torch.relu(m.b(y)), h, n


def _skip_c(m: nn.Module, y: Tensor, h: Tensor, n: int) -> tuple[Tensor, Tensor, int]:
    return m.c(y), h, n


def _skip_d(m: nn.Module, y: Tensor, h: Tensor, n: int) -> Tensor:
    assert isinstance(n, int) and n == 2
    out: Tensor = m.d(y + h)
    return out


SKIP_STEPS = [("a", _skip_a), ("b", _skip_b), ("c", _skip_c), ("d", _skip_d)]


def skip_stages(model: Skip, k: int) -> list[nn.Module]:
    groups = _group(k, len(SKIP_STEPS))
    return [
        Steps(model, [SKIP_STEPS[s][0] for s in g], [SKIP_STEPS[s][1] for s in g]) for g in groups
    ]


def chain_stages(model: Chain, k: int) -> list[nn.Module]:
    n = len(model.net)
    return [model.net[g[0] : g[-1] + 1] for g in _group(k, n)]


def _assert_grads_match(pipe: nn.Module, ref: nn.Module) -> None:
    assert len({id(p) for p in pipe.parameters()}) == len(list(ref.parameters()))
    for (name, p), q in zip(ref.named_parameters(), _params_in_ref_order(pipe, ref), strict=True):
        assert q.grad is not None and p.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def _params_in_ref_order(pipe: nn.Module, ref: nn.Module) -> list[Tensor]:
    """The pipeline's parameters, keyed through its original-named state_dict."""
    state = pipe.state_dict(keep_vars=True)
    return [state[name] for name, _ in ref.named_parameters()]


def _run(pipe: nn.Module, ref: nn.Module, x: Tensor) -> None:
    out = pipe(x)
    loss = out.pow(2).mean()
    loss.backward()
    ref_out = ref(x)
    ref_loss = ref_out.pow(2).mean()
    ref_loss.backward()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(loss, ref_loss)
    _assert_grads_match(pipe, ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.compat
def test_chain_matches_unpipelined(k: int, mode: str) -> None:
    model = Chain()
    ref = copy.deepcopy(model)
    pipe = GPipe(
        chain_stages(model, k), ["cpu"] * k, chunks=3, recompute=mode, key_prefixes=["net."] * k
    )
    _run(pipe, ref, torch.randn(7, 8))  # 7 = 3 + 2 + 2: uneven micro-batches


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.compat
def test_skip_and_int_passed_through_middle_stages(k: int, mode: str) -> None:
    model = Skip()
    ref = copy.deepcopy(model)
    pipe = GPipe(skip_stages(model, k), ["cpu"] * k, chunks=4, recompute=mode)
    _run(pipe, ref, torch.randn(10, 8))


@pytest.mark.parametrize("mode", MODES)
def test_worker_threads_match_inline(mode: str) -> None:
    model = Skip()
    ref = copy.deepcopy(model)
    pipe = GPipe(skip_stages(model, 3), ["cpu"] * 3, chunks=4, recompute=mode, threads=True)
    _run(pipe, ref, torch.randn(8, 8))


def test_two_inputs_and_dict_output() -> None:
    model = MultiIO()
    ref = copy.deepcopy(model)

    def first(m: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, int]:
        return m.x_proj(x) + m.y_proj(y), x.size(1)

    def second(m: nn.Module, h: Tensor, n: int) -> dict[str, Tensor]:
        h = h.reshape(-1, n)
        return {"logits": m.out(h), "hidden": h}

    stages = [Steps(model, ["x_proj", "y_proj"], [first]), Steps(model, ["out"], [second])]
    pipe = GPipe(stages, ["cpu", "cpu"], chunks=3, recompute="always")
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    out, want = pipe(x, y), ref(x, y)
    assert set(out) == {"logits", "hidden"}
    for key in out:
        torch.testing.assert_close(out[key], want[key])
    (out["logits"].sum() + out["hidden"].pow(2).sum()).backward()
    (want["logits"].sum() + want["hidden"].pow(2).sum()).backward()
    _assert_grads_match(pipe, ref)


def test_adamw_steps_keep_parameters_equal() -> None:
    model = Chain()
    ref = copy.deepcopy(model)
    pipe = GPipe(chain_stages(model, 3), ["cpu"] * 3, chunks=4, key_prefixes=["net."] * 3)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    before = copy.deepcopy(ref.state_dict())
    for _ in range(3):
        x, target = torch.randn(8, 8), torch.randn(8, 4)
        for m, o in ((pipe, opt), (ref, ref_opt)):
            o.zero_grad()
            F.mse_loss(m(x), target).backward()
            o.step()
    for (name, want), got in zip(
        ref.named_parameters(), _params_in_ref_order(pipe, ref), strict=True
    ):
        torch.testing.assert_close(got, want, msg=name)
        assert not torch.equal(want, before[name])  # the steps did move them


def _dropouty_stages(model: Dropouty, k: int) -> list[nn.Module]:
    steps = [
        ("l1", lambda m, x: F.relu(m.l1(x))),
        ("drop", lambda m, x: m.drop(x)),
        ("l2", lambda m, x: F.relu(m.l2(x))),
        ("l3", lambda m, x: m.l3(x)),
    ]
    return [Steps(model, [steps[s][0] for s in g], [steps[s][1] for s in g]) for g in _group(k, 4)]


def _dropout_run(mode: str, k: int, chunks: int) -> tuple[Tensor, list[Tensor]]:
    torch.manual_seed(0)
    model = Dropouty()
    pipe = GPipe(_dropouty_stages(model, k), ["cpu"] * k, chunks=chunks, recompute=mode)
    x = torch.randn(12, 16)
    torch.manual_seed(123)
    out = pipe(x)
    out.pow(2).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("k", [2, 3])
def test_dropout_recomputation_replays_masks(k: int) -> None:
    """Recomputation replays the masks: every mode gives the same outputs and gradients."""
    out, grads = _dropout_run("never", k, chunks=4)
    for mode in ("always", "except_last"):
        out2, grads2 = _dropout_run(mode, k, chunks=4)
        torch.testing.assert_close(out2, out)
        for a, b in zip(grads2, grads, strict=True):
            torch.testing.assert_close(a, b)


def test_dropout_matches_model_run_micro_batch_by_micro_batch() -> None:
    """Only one stage draws random numbers, so it draws them micro-batch 0, 1, ... in turn:
    exactly what the plain model does when fed the same micro-batches one by one. (Against a
    single full-batch call the masks differ: one draw of 12 rows is not four draws of 3.)"""
    out, grads = _dropout_run("always", 3, chunks=4)
    torch.manual_seed(0)
    ref = Dropouty()
    x = torch.randn(12, 16)
    torch.manual_seed(123)
    want = torch.cat([ref(mb) for mb in torch.tensor_split(x, 4)])
    want.pow(2).sum().backward()
    torch.testing.assert_close(out, want)
    for a, p in zip(grads, ref.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad)


class Counting(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        out: Tensor = self.inner(x)
        return out


def _counting_pipe(mode: str) -> tuple[GPipe, list[Counting]]:
    stages = [Counting(nn.Linear(4, 4)), Counting(nn.Linear(4, 4))]
    return GPipe(stages, ["cpu", "cpu"], chunks=4, recompute=mode), stages


def test_recomputation_counts_per_mode() -> None:
    for mode, per_stage in (("always", 8), ("except_last", 7), ("never", 4)):
        pipe, stages = _counting_pipe(mode)
        pipe(torch.randn(8, 4)).sum().backward()
        assert [s.calls for s in stages] == [per_stage, per_stage], mode


def test_no_recomputation_in_eval_or_no_grad() -> None:
    pipe, stages = _counting_pipe("always")
    ref = nn.Sequential(stages[0].inner, stages[1].inner)
    x = torch.randn(8, 4, requires_grad=True)
    pipe.eval()
    out = pipe(x)
    out.sum().backward()  # eval with grad: plain autograd, no recomputation
    torch.testing.assert_close(out, ref(x))
    assert [s.calls for s in stages] == [4, 4]
    pipe.train()
    with torch.no_grad():
        assert not pipe(x).requires_grad
    assert [s.calls for s in stages] == [8, 8]


def _saved_bytes(mode: str) -> int:
    torch.manual_seed(0)
    model = Chain((64, 256, 256, 256, 256, 8))
    pipe = GPipe(chain_stages(model, 2), ["cpu", "cpu"], chunks=4, recompute=mode)
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pipe(torch.randn(32, 64))
    out.sum().backward()
    return total


def test_checkpointing_lowers_saved_activation_bytes() -> None:
    never, except_last, always = (_saved_bytes(m) for m in ("never", "except_last", "always"))
    assert always < except_last < never
    assert always < 0.5 * never  # only stage inputs are kept


def test_state_dict_uses_original_keys_and_loads_plain_state_dict() -> None:
    model = Skip()
    pipe = GPipe(skip_stages(model, 3), ["cpu"] * 3, chunks=2)
    assert list(pipe.state_dict()) == list(Skip().state_dict())
    other = Skip()
    assert pipe.load_state_dict(other.state_dict()) is not None
    for key, value in other.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value)
    assert model.a.weight is pipe.stages[0].a.weight  # loaded in place into the stages


def test_key_prefixes_map_sequential_slices_to_model_keys() -> None:
    model = Chain()
    pipe = GPipe(chain_stages(model, 2), ["cpu"] * 2, chunks=2, key_prefixes=["net.", "net."])
    assert sorted(pipe.state_dict()) == sorted(model.state_dict())
    pipe.load_state_dict(Chain().state_dict())


def test_load_state_dict_reports_missing_and_unexpected_keys_like_torch() -> None:
    pipe = GPipe(skip_stages(Skip(), 2), ["cpu"] * 2, chunks=2)
    state = Skip().state_dict()
    del state["c.bias"]
    state["e.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "c.bias"'):
        pipe.load_state_dict(state)
    result = pipe.load_state_dict(state, strict=False)
    assert result.missing_keys == ["c.bias"]
    assert result.unexpected_keys == ["e.weight"]


class Tied(nn.Module):
    """One Linear used twice (a tie), the second time in another stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.a(self.b(self.a(x)))
        return out


def _tied_stages(model: Tied) -> list[nn.Module]:
    return [
        Steps(model, ["a"], [lambda m, x: m.a(x)]),
        Steps(model, ["b", "a"], [lambda m, x: m.a(m.b(x))]),
    ]


def test_tied_parameter_on_one_device_stays_tied_and_appears_once() -> None:
    model = Tied()
    ref = copy.deepcopy(model)
    weight = model.a.weight
    pipe = GPipe(_tied_stages(model), ["cpu", "cpu"], chunks=2)
    assert pipe.stages[0].a.weight is pipe.stages[1].a.weight is weight
    assert list(pipe.state_dict()) == ["a.weight", "a.bias", "b.weight", "b.bias"]
    _run(pipe, ref, torch.randn(4, 4))


def test_parameters_keep_identity_when_already_placed() -> None:
    model = Chain()
    params = list(model.parameters())
    pipe = GPipe(chain_stages(model, 2), ["cpu", "cpu"], chunks=2)
    assert all(a is b for a, b in zip(pipe.parameters(), params, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"devices": ["cpu"]}, PlacementError, r"got 1 devices for 2 stages"),
        ({"chunks": 0}, ExecutorError, r"chunks=0 < 1"),
        (
            {"recompute": "sometimes"},
            ExecutorError,
            r"recompute='sometimes' is not a recompute mode",
        ),
        ({"key_prefixes": ["x."]}, ExecutorError, r"got 1 key_prefixes for 2 stages"),
    ],
)
def test_bad_configuration(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    args: dict[str, Any] = {
        "stages": chain_stages(Chain(), 2),
        "devices": ["cpu", "cpu"],
        "chunks": 2,
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        GPipe(**args)


def test_empty_stages() -> None:
    with pytest.raises(ExecutorError, match="stages is empty"):
        GPipe([], [], chunks=1)


def test_bad_inputs_at_call_time() -> None:
    pipe = GPipe([nn.Linear(4, 4)], ["cpu"], chunks=8)
    with pytest.raises(MicroBatchError, match=r"chunks=8 > batch size 4"):
        pipe(torch.randn(4, 4))
    two = GPipe(
        [Steps(MultiIO(), ["x_proj"], [lambda m, x, y: m.x_proj(x) + y])], ["cpu"], chunks=2
    )
    with pytest.raises(MicroBatchError, match=r"inconsistent batch sizes \[4, 3\]"):
        two(torch.randn(4, 8), torch.randn(3, 8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda() -> None:
    with pytest.raises(PlacementError, match=r"'cuda:0' requested but CUDA is not available"):
        GPipe([nn.Linear(2, 2)], ["cuda:0"], chunks=1)


def test_stage_exception_propagates_and_resets() -> None:
    class Boom(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise RuntimeError("boom in stage")

    for threads in (False, True):
        pipe = GPipe([nn.Linear(4, 4), Boom()], ["cpu", "cpu"], chunks=2, threads=threads)
        with pytest.raises(RuntimeError, match="boom in stage"):
            pipe(torch.randn(4, 4))


@skip_if_no_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_two_stages_match_unpipelined(mode: str) -> None:
    model = Skip()
    ref = copy.deepcopy(model).cuda()
    pipe = GPipe(skip_stages(model, 2), ["cuda:0", "cuda:0"], chunks=4, recompute=mode)
    _run(pipe, ref, torch.randn(8, 8, device="cuda"))


@skip_if_no_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_two_devices_copy_streams() -> None:
    model = Skip()
    ref = copy.deepcopy(model).cuda(0)
    pipe = GPipe(skip_stages(model, 2), ["cuda:0", "cuda:1"], chunks=4, recompute="except_last")
    x = torch.randn(8, 8, device="cuda:0")
    out = pipe(x)
    assert out.device == torch.device("cuda:1")
    out.pow(2).mean().backward()
    want = ref(x)
    want.pow(2).mean().backward()
    torch.testing.assert_close(out.cpu(), want.cpu())
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), msg=lambda m, n=name: f"{n}: {m}")


def test_benchmark_against_torchgpipe_smoke() -> None:
    pytest.importorskip("torchgpipe")
    from benchmarks.executor_vs_torchgpipe import main

    (row,) = main(
        [
            "--models",
            "mlp",
            "--batch",
            "8",
            "--chunks",
            "2",
            "--checkpoints",
            "except_last",
            "--repeats",
            "1",
            "--threads",
            "1",
        ]
    )
    assert (row.model, row.batch, row.chunks, row.recompute) == ("mlp", 8, 2, "except_last")
    assert row.max_grad_diff < 1e-5  # both pipelines computed the same gradients
    assert row.ratio == pytest.approx(row.executor_ms / row.torchgpipe_ms)
    assert all(math.isfinite(t) and t > 0 for t in (row.executor_ms, row.threaded_ms, row.torchgpipe_ms))


def test_state_dict_round_trip_when_nested_in_a_parent_module() -> None:
    parent = nn.Module()
    parent.pipe = GPipe(skip_stages(Skip(), 2), ["cpu"] * 2, chunks=2)
    want = {"pipe." + k for k in Skip().state_dict()}
    assert set(parent.state_dict()) == want
    state = {"pipe." + k: v for k, v in Skip().state_dict().items()}
    del state["pipe.d.bias"]
    result = parent.load_state_dict(state, strict=False)
    assert result.missing_keys == ["pipe.d.bias"] and result.unexpected_keys == []


def test_checkpoint_is_recomputes_old_name_for_one_release() -> None:
    """[Note: recompute, not checkpoint]: GPipe(checkpoint=) runs as GPipe(recompute=), warned."""
    stages = [nn.Linear(4, 4), nn.Linear(4, 4)]
    with pytest.warns(DeprecationWarning, match=r"^GPipe\(checkpoint='never'\) is now "
                                                 r"GPipe\(recompute='never'\)"):
        pipe = GPipe(stages, ["cpu", "cpu"], chunks=2, checkpoint="never")
    assert pipe.recompute == "never" and pipe.recompute_modes == ["never", "never"]


def test_a_move_off_the_stages_devices_is_refused_in_one_line() -> None:
    """[Note: a pipeline stays where it was placed]: as HuggingFace's Trainer and accelerate
    move the model they are given."""
    pipe = GPipe([nn.Linear(4, 4), nn.Linear(4, 2)], ["cpu", "cpu"], chunks=2)
    for move, call in [(lambda: pipe.to("meta"), r"pipe\.to\(\.\.\.\)"), (lambda: pipe.cuda(), r"pipe\.cuda\(\)"),
                       (lambda: pipe.to(device="meta"), r"pipe\.to\(\.\.\.\)"),
                       (lambda: pipe.to(torch.empty(0, device="meta")), r"pipe\.to\(\.\.\.\)")]:
        with pytest.raises(PlacementError, match=rf"^{call} would move stages on cpu onto (meta|cuda)\S*, but "
                           r"each stage runs on the device the pipeline was built for \(cpu, cpu\); build the "
                           r"pipeline for the devices you want instead: pipeline\(model, \.\.\., devices=\[\.\.\.\]\)$"):
            move()
    assert all(p.device.type == "cpu" for p in pipe.parameters())
    assert pipe.to("cpu") is pipe and pipe.cpu() is pipe  # nothing moves: allowed
    pipe.to(torch.float64)  # a dtype alone
    assert all(p.dtype == torch.float64 for p in pipe.parameters())
    assert pipe(torch.ones(4, 4, dtype=torch.float64)).dtype == torch.float64
