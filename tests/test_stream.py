from __future__ import annotations

import torch

from executor.microbatch import Batch
from executor.stream import (
    CPU_STREAM,
    Copy,
    CPUStream,
    Wait,
    copy,
    current_stream,
    default_stream,
    get_device,
    is_cuda,
    new_stream,
    record_stream,
    use_device,
    use_stream,
    wait,
    wait_stream,
)
from tests.conftest import skip_if_no_cuda

CPU = torch.device("cpu")


def test_cpu_streams_are_one_no_op_sentinel() -> None:
    assert CPUStream() is CPU_STREAM
    assert new_stream(CPU) is current_stream(CPU) is default_stream(CPU) is CPU_STREAM
    assert get_device(CPU_STREAM) == CPU and not is_cuda(CPU_STREAM)
    x = torch.ones(2)
    with use_device(CPU), use_stream(CPU_STREAM):
        wait_stream(CPU_STREAM, CPU_STREAM)
        record_stream(x, CPU_STREAM)
    assert repr(CPU_STREAM) == "CPU_STREAM"


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
