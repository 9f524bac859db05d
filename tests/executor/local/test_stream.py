from __future__ import annotations

import torch

from executor.local.stream import (
    CPU_STREAM,
    Copy,
    CPUStream,
    Wait,
    copy,
    current_stream,
    get_device,
    is_cuda,
    new_stream,
    record_stream,
    use_device,
    use_stream,
    wait,
    wait_stream,
)
from executor.microbatch import Batch
from tests.conftest import skip_if_no_cuda

CPU = torch.device("cpu")


class FakeCudaStream:
    """Records what the stream helpers ask of a CUDA stream (the CPU tests of the CUDA logic)."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []  # type: ignore[var-annotated]

    def wait_stream(self, other: object) -> None:
        self.calls.append(("wait_stream", other))

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))


class FakeCudaTensor:
    is_cuda = True

    def __init__(self) -> None:
        self.recorded: list[object] = []

    def record_stream(self, stream: object) -> None:
        self.recorded.append(stream)


def test_cpu_streams_are_one_no_op_sentinel() -> None:
    assert CPUStream() is CPU_STREAM
    assert new_stream(CPU) is current_stream(CPU) is CPU_STREAM
    assert get_device(CPU_STREAM) == CPU and not is_cuda(CPU_STREAM)
    assert repr(CPU_STREAM) == "CPU_STREAM"


def test_wait_stream_orders_the_right_side() -> None:
    a, b = FakeCudaStream("a"), FakeCudaStream("b")
    wait_stream(a, b)  # device work on a waits for device work on b
    assert a.calls == [("wait_stream", b)] and b.calls == []
    wait_stream(CPU_STREAM, b)  # the host waits: it must block until b is done
    assert b.calls == [("synchronize",)]
    wait_stream(a, CPU_STREAM)  # host work is done by the time the host queues more: nothing
    assert a.calls == [("wait_stream", b)]
    with use_device(CPU), use_stream(CPU_STREAM):
        wait_stream(CPU_STREAM, CPU_STREAM)


def test_record_stream_tells_the_allocator_only_about_cuda_tensors_on_cuda_streams() -> None:
    side, t = FakeCudaStream("side"), FakeCudaTensor()
    record_stream(t, side)  # type: ignore[arg-type]
    record_stream(t, CPU_STREAM)  # type: ignore[arg-type]
    assert t.recorded == [side]
    cpu = torch.ones(2)
    record_stream(cpu, side)  # type: ignore[arg-type] # a CPU tensor has no allocator stream
    record_stream(cpu, CPU_STREAM)


def test_copy_and_wait_pass_values_and_gradients_on_cpu() -> None:
    x = torch.randn(3, requires_grad=True)
    ids = torch.arange(3)
    y, i = Copy.apply(CPU_STREAM, CPU_STREAM, x, ids)
    z, j = Wait.apply(CPU_STREAM, CPU_STREAM, y * 2, i)
    torch.testing.assert_close(z, x * 2)
    assert torch.equal(j, ids) and not j.requires_grad
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_batch_helpers_keep_structure() -> None:
    x = torch.randn(2, 2, requires_grad=True)
    batch = Batch((x, "tag", {"k": x}))
    copied = copy(batch, CPU_STREAM, CPU_STREAM)
    assert copied.values[1] == "tag"
    torch.testing.assert_close(copied.values[2]["k"], x)
    assert wait(batch, CPU_STREAM, CPU_STREAM) is batch  # nothing to order on CPU
    assert copy(Batch((1, 2)), CPU_STREAM, CPU_STREAM).values == (1, 2)


@skip_if_no_cuda
def test_copy_to_cuda_on_side_stream_and_back() -> None:
    dev = torch.device("cuda", 0)
    side = new_stream(dev)
    assert is_cuda(side) and get_device(side) == dev
    x = torch.randn(64, requires_grad=True)
    (y,) = Copy.apply(CPU_STREAM, side, x)
    (y,) = Wait.apply(side, current_stream(dev), y)
    assert y.device == dev
    (y * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((64,), 3.0))
