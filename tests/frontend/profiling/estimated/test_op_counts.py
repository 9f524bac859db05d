"""[Note: counted, not timed]: each op's FLOPs and bytes against counts done by hand, and a call's
time the sheet's roofline summed over them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopipe.core.device_sheet import DeviceSheet, load_sheet
from autopipe.frontend.profiling.estimated.op_counts import CountingTimer, Op, OpCounter, op_class
from executor._torch_compat import FakeTensorMode

M, K, N = 32, 64, 128


def _sheet() -> DeviceSheet:  # round numbers, so that the roofline can be worked out by hand
    data = load_sheet("h100").to_json()
    data.update(peak_flops_fp32=1e12, peak_flops_bf16=4e12, memory_bandwidth=1e9, efficiency_matmul=0.5,
                efficiency_elementwise=1.0, efficiency_attention=0.25, launch_us=10.0)
    return DeviceSheet.from_json(data, "test sheet")


def test_a_linear_layer_is_one_matmul_of_2mnk_flops_reading_and_writing_its_tensors() -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        linear, x = torch.nn.Linear(K, N), torch.empty(M, K)
        with OpCounter() as counter:
            linear(x)
    # addmm(bias, x, weight.t()): the transpose is a view, free
    assert counter.ops == [Op("matmul", "fp32", 2 * M * N * K, 4 * (N + M * K + K * N + M * N))]


def test_a_calls_time_is_the_roofline_of_its_ops_plus_a_launch_each() -> None:
    timer, sheet = CountingTimer(_sheet()), _sheet()
    with FakeTensorMode(allow_non_fake_inputs=True):
        a, b = torch.empty(M, K), torch.empty(K, N)
        _, ms = timer(lambda: torch.relu(a @ b))
    flops, mm_bytes, relu_bytes = 2 * M * N * K, 4 * (M * K + K * N + M * N), 4 * 2 * M * N
    # matmul: memory-bound here (bytes / 1e9 > flops / 1e12), at half the roofline; relu: bytes
    expected = (1e3 * max(flops / 1e12, mm_bytes / 1e9) / 0.5 + 0.01) + (1e3 * relu_bytes / 1e9 + 0.01)
    assert ms == pytest.approx(expected)
    assert [op.op_class for op in timer.ops] == ["matmul", "elementwise"]
    assert ms == pytest.approx(sum(sheet.op_ms(o.op_class, o.dtype, o.flops, o.nbytes) for o in timer.ops))


def test_views_and_allocations_cost_nothing_a_copy_is_one_kernel() -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(M, K)
        with OpCounter() as free:
            x.view(K, M).reshape(-1)[:3]
            torch.empty(M, K)
        with OpCounter() as copied:
            x.t().reshape(-1)  # not contiguous: reshape copies
    assert free.ops == []
    assert copied.ops == [Op("elementwise", "fp32", 0, 2 * 4 * M * K)]


def test_causal_attention_counts_half_the_scores_and_autocast_computes_in_bf16() -> None:
    b, h, s, d = 2, 4, 16, 8
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(b, h, s, d)
        with OpCounter() as full:
            F.scaled_dot_product_attention(q, q, q)
        with OpCounter() as causal:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with OpCounter() as low, torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.Linear(K, N)(torch.empty(M, K))
    # two batched matmuls of the scores: q @ k^T and p @ v, each 2 b h s s d
    assert [(o.op_class, o.flops) for o in full.ops] == [("attention", 2 * 2 * b * h * s * s * d)]
    assert [o.flops for o in causal.ops] == [2 * b * h * s * s * d]
    assert [(o.op_class, o.dtype) for o in low.ops if o.flops] == [("matmul", "bf16")]


def test_an_op_is_attention_by_name_else_matmul_by_its_flops() -> None:
    assert op_class("_scaled_dot_product_flash_attention_for_cpu", 0) == "attention"
    assert op_class("addmm", 10) == "matmul" and op_class("add", 0) == "elementwise"
