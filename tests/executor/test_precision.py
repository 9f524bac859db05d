"""Mixed precision in executor.GPipe: the caller's autocast on worker threads and in every
recomputation ([Note: autocast follows the stage]), and ``precision=`` ([Note: mixed precision])."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from autopipe.frontend.building.stages import RecomputedLayer
from executor.errors import ExecutorError
from executor.local.gpipe import GPipe
from executor.precision import AutocastState, compute_dtype, precision_autocast
from executor.recompute import is_recomputing
from tests.conftest import skip_if_no_cuda

MODES = ["always", "except_last", "never"]
CHUNKS = 4
BF16 = torch.bfloat16


class Seen(nn.Module):
    """Records, at every call, whether CPU autocast was on, its dtype, the thread and whether
    this call is a recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, torch.dtype, str, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.calls.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                           threading.current_thread().name, is_recomputing()))
        return x


class Mid(nn.Module):
    """``F.linear`` of its input with its own fp32 weight: under autocast the input arrives in
    bf16 (the previous stage's Linear made it), and without autocast the matmul refuses the
    mix of bf16 and fp32 -- what a recomputation without the forward's autocast ran into."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)
        self.norm = nn.LayerNorm(16)
        self.seen = Seen()

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(F.gelu(F.linear(self.seen(x), self.weight)))


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 16), nn.GELU()), Mid(), nn.Linear(16, 4)]


def _plain(stages: list[nn.Module], x: Tensor) -> Tensor:
    """The unpipelined model on the same micro-batches (in the caller's autocast, if any)."""
    model = nn.Sequential(*stages)
    return torch.cat([model(xi) for xi in x.tensor_split(CHUNKS)])


def _loss(out: Tensor) -> Tensor:
    return out.float().pow(2).mean()


def _close(actual: Tensor, expected: Tensor, what: str, tol: float = 2e-2) -> None:
    """Equal at bf16's tolerance: the largest difference within ``tol`` of the largest value
    (gradients of bf16 matmuls are summed in another order, so are not bit-exact)."""
    scale = expected.abs().max().item() + 1e-6
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def _compare(pipe_stages: list[nn.Module], ref_stages: list[nn.Module], out: Tensor,
             ref: Tensor) -> None:
    assert out.dtype == ref.dtype
    _close(out, ref, "output")
    _loss(out).backward()
    _loss(ref).backward()
    for (name, p), q in zip(nn.Sequential(*pipe_stages).named_parameters(),
                            nn.Sequential(*ref_stages).parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert p.grad.dtype == torch.float32 and p.dtype == torch.float32  # fp32 masters
        _close(p.grad, q.grad, name)


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_callers_autocast_on_threads_and_in_recomputation(mode: str, threads: bool) -> None:
    stages, ref_stages = _stages(), _stages()
    x = torch.randn(8, 8)
    pipe = GPipe(stages, ["cpu"] * 3, CHUNKS, recompute=mode, threads=threads)
    with torch.autocast("cpu", dtype=BF16):
        out = pipe(x)
        ref = _plain(ref_stages, x)
    assert out.dtype == BF16
    _compare(stages, ref_stages, out, ref)  # backward outside the autocast, as torch advises
    calls = stages[1].seen.calls
    recomputed = {"always": CHUNKS, "except_last": CHUNKS - 1, "never": 0}[mode]
    assert len(calls) == CHUNKS + recomputed
    assert sum(r for *_, r in calls) == recomputed
    assert all(on and dtype == BF16 for on, dtype, _, _ in calls), calls  # forward and recompute
    forwards = {name for _, _, name, r in calls if not r}
    assert forwards == ({"gpipe-cpu"} if threads else {threading.current_thread().name})


@pytest.mark.parametrize("mode", ["always", "never"])
def test_precision_bf16_equals_the_plain_model_under_autocast(mode: str) -> None:
    stages, ref_stages = _stages(), _stages()
    x = torch.randn(8, 8)
    pipe = GPipe(stages, ["cpu"] * 3, CHUNKS, recompute=mode, threads=True, precision="bf16")
    assert pipe.precision == "bf16"
    out = pipe(x)  # no autocast here: the pipeline's own, in every stage
    assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=BF16):
        ref = _plain(ref_stages, x)
    _compare(stages, ref_stages, out, ref)
    assert all(on and dtype == BF16 for on, dtype, _, _ in stages[1].seen.calls)


def test_recomputation_replays_the_forwards_state_exactly() -> None:
    """Forward in fp32, backward inside an autocast block: the recomputation runs in fp32, as
    the forward did, not in the backward's autocast (both backwards run under it)."""
    stages, ref_stages = _stages(), _stages()
    x = torch.randn(8, 8)
    out = GPipe(stages, ["cpu"] * 3, CHUNKS, recompute="always")(x)
    ref = _plain(ref_stages, x)
    with torch.autocast("cpu", dtype=BF16):
        _loss(out).backward()
        _loss(ref).backward()
    assert [on for on, *_ in stages[1].seen.calls] == [False] * (2 * CHUNKS)
    for p, q in zip(nn.Sequential(*stages).parameters(), nn.Sequential(*ref_stages).parameters(),
                    strict=True):
        torch.testing.assert_close(p.grad, q.grad)


class Segment(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


class WithSegment(nn.Module):
    """A stage whose middle is a recomputed layer segment (torch's reentrant checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.segment = RecomputedLayer(fx.symbolic_trace(Segment()))
        self.seen = Seen()

    def forward(self, x: Tensor) -> Tensor:
        return self.seen(self.segment(x))


def test_recomputed_layer_segments_keep_the_autocast() -> None:
    torch.manual_seed(0)
    stages = [nn.Linear(8, 16), WithSegment(), nn.Linear(16, 4)]
    ref_stages = copy.deepcopy(stages)
    x = torch.randn(8, 8)
    pipe = GPipe(stages, ["cpu"] * 3, CHUNKS, recompute="never", threads=True)
    with torch.autocast("cpu", dtype=BF16):
        out = pipe(x)
        ref = _plain(ref_stages, x)
    _compare(stages, ref_stages, out, ref)


def test_bad_precision_is_one_line() -> None:
    with pytest.raises(ExecutorError, match=r"^precision='fp8' is unknown; use one of fp32, bf16, "
                                            r"fp16$"):
        GPipe(_stages(), ["cpu"] * 3, CHUNKS, precision="fp8")


def test_autocast_state_and_precision_helpers() -> None:
    off = AutocastState.capture()
    assert not off.enabled
    with torch.autocast("cpu", dtype=BF16):
        on = AutocastState.capture()
        with off.apply():  # exactly the captured state: autocast off
            assert not torch.is_autocast_enabled("cpu")
    with on.apply():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16
    assert not torch.is_autocast_enabled("cpu")
    assert [compute_dtype(p) for p in ("fp32", "bf16", "fp16")] == [torch.float32, BF16, torch.float16]
    with precision_autocast("fp32", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")


@skip_if_no_cuda
@pytest.mark.parametrize("mode", ["always", "never"])
def test_cuda_workers_and_recomputation_keep_the_callers_autocast(mode: str) -> None:
    """Two stages on cuda, one on the CPU: three devices' worker threads, and backward on
    autograd's device threads, all under the caller's CUDA autocast."""
    stages, ref_stages = _stages(), _stages()
    devices = ["cuda:0", "cpu", "cuda:0"] if torch.cuda.device_count() < 2 else ["cuda:0", "cuda:1", "cuda:0"]
    for s, r, d in zip(stages, ref_stages, devices, strict=True):
        s.to(d)
        r.to(d)
    x = torch.randn(8, 8, device="cuda:0")
    pipe = GPipe(stages, devices, CHUNKS, recompute=mode, precision="fp32")
    with torch.autocast("cuda", dtype=BF16), torch.autocast("cpu", dtype=BF16):
        out = pipe(x)
        ref = torch.cat([ref_stages[2](ref_stages[1](ref_stages[0](xi).to(devices[1])).to(devices[2]))
                         for xi in x.tensor_split(CHUNKS)])
    _compare(stages, ref_stages, out, ref)
