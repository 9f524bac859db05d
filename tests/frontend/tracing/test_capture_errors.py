"""A model that cannot be traced gets one line: the user's line of code and the fix that applies,
with none of torch's own log output ([Note: the user's line], [Note: a quiet tracer])."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import Tensor, nn

from autopipe import TraceError
from autopipe.frontend.tracing.graph import trace
from tests.models import Untraceable

with open("tests/models.py") as _f:  # Untraceable's data-dependent branch
    BRANCH = "tests/models.py:" + str(next(i for i, line in enumerate(_f, start=1)
                                           if "h.sum().item()" in line))


def one_line(err: pytest.ExceptionInfo[TraceError]) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_the_users_line_is_named_for_the_models_own_forward() -> None:
    with pytest.raises(TraceError) as info:
        trace(Untraceable(), (torch.randn(2, 4),))
    message = one_line(info)
    assert message.startswith(f"cannot trace Untraceable: torch.fx failed in the model's own "
                              f"forward at {BRANCH} (TraceError: symbolically traced variables "
                              f"cannot be used as inputs to control flow); torch.export failed at "
                              f"{BRANCH} (GuardOnDataDependentSymNode: ")
    assert message.endswith(f". Remove the data-dependent Python control flow at {BRANCH} (if/for "
                            "on tensor values, .item(), int(tensor)) or pass the values it "
                            "depends on as constant kwargs=...")
    assert "<root>" not in message and "leaf_modules" not in message


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = Untraceable()

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(self.pre(x))


def test_a_submodule_that_breaks_tracing_may_be_marked_a_leaf() -> None:
    with pytest.raises(TraceError) as info:
        trace(Wrapper(), (torch.randn(2, 4),))
    message = one_line(info)
    assert f"torch.fx failed in module 'inner' at {BRANCH} (" in message
    assert message.endswith(f"Mark 'inner' a leaf (trace(..., leaf_modules=['inner'])) so "
                            f"torch.fx keeps it whole, or remove the data-dependent Python control "
                            f"flow at {BRANCH} (if/for on tensor values, .item(), int(tensor)) or "
                            "pass the values it depends on as constant kwargs=...")


class BadView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).view(x.shape[0] * 2, -1, 7)


def test_a_graph_that_does_not_run_on_the_inputs_names_the_line() -> None:
    line = f"tests/frontend/tracing/test_capture_errors.py:{BadView.forward.__code__.co_firstlineno + 1}"
    with pytest.raises(TraceError) as info:
        trace(BadView(), (torch.randn(4, 4),))
    message = one_line(info)
    assert f"torch.fx failed at {line} (its graph did not run on the example inputs: " in message
    assert message.endswith(f"The model's code at {line} fails on these example inputs: check "
                            "their shapes and dtypes against what that line expects")


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.proj(x)
        return h if mask is None else h * mask


BATCH_ADVICE = ("kwargs are constants of the graph; pass it in example_kwargs= to make it a "
                "keyword input that the pipeline splits into micro-batches")


def test_a_batch_sized_kwarg_must_be_positional() -> None:
    x = torch.randn(2, 4)
    with pytest.raises(TraceError) as info:
        trace(Masked(), (x,), kwargs={"mask": torch.ones(2, 4)})
    assert one_line(info) == f"kwargs['mask'] is a tensor of 2 rows, like the inputs' batch: {BATCH_ADVICE}"
    trace(Masked(), (x,), kwargs={"mask": torch.ones(4)})  # a constant of the model's width: fine


def test_a_whole_batch_kwarg_traced_on_a_micro_batch_must_be_positional() -> None:
    import autopipe

    x = torch.randn(8, 4)
    with pytest.raises(TraceError) as info:  # traced on 4 rows (2 chunks), the mask has 8
        autopipe.pipeline(Masked(), (x,), devices=["cpu", "cpu"], chunks=2,
                          kwargs={"mask": torch.ones(8, 4)})
    message = one_line(info)
    assert message.startswith("cannot trace Masked: ")
    assert message.endswith(f". kwargs['mask'] is a tensor of 8 rows, like the inputs' batch: "
                            f"{BATCH_ADVICE}")
    assert "pass constant arguments" not in message


class LogsLikeTorch(nn.Module):
    """Logs through torch's loggers while traced, as fake tensors and torch.export do (36-57 W/E
    lines per traced HF model in issue 11), then fails on a data-dependent size."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        logging.getLogger("torch.fx.experimental.symbolic_shapes").warning("guard noise")
        logging.getLogger("torch._subclasses.fake_tensor.made_while_tracing").error("fake noise")
        n = int(x.abs().sum() > 0) + 3
        return self.proj(x)[:, :n]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_torchs_log_lines_are_silenced_around_the_tracer_only(
    capfd: pytest.CaptureFixture[str],
) -> None:
    x = torch.randn(4, 4)
    records = Records()
    heard = ["torch.fx.experimental.symbolic_shapes", "torch._subclasses.fake_tensor"]
    for name in heard:  # torch's loggers do not propagate: listen where torch prints
        logging.getLogger(name).addHandler(records)
    loggers = ["torch", *heard, "torch._dynamo"]
    levels = [logging.getLogger(name).level for name in loggers]
    try:
        with pytest.raises(TraceError, match="Remove the data-dependent Python control flow"):
            trace(LogsLikeTorch(), (x,))
        assert records.messages == []
        captured = capfd.readouterr()
        assert captured.err == captured.out == ""  # no partial graphs printed either
        assert [logging.getLogger(name).level for name in loggers] == levels
        LogsLikeTorch()(x)  # outside the tracer the same loggers are heard, the new one too
        assert records.messages == ["guard noise", "fake noise"]
    finally:
        for name in heard:
            logging.getLogger(name).removeHandler(records)
