"""executor.GPipe vs torchgpipe 0.0.7: the same model, balance, chunks and recompute mode.

Both run in one process on ``["cpu", "cpu"]`` (two stages on one device: one worker, no copies),
so the comparison measures the runtimes' own overheads: scattering, scheduling, autograd
plumbing and recomputation. Each measurement is one full forward + backward; the two pipelines
alternate within each repeat so drift hits both alike. Prints a markdown table; the ratio is
executor / torchgpipe (lower is better, target <= 1.0). "executor (thread)" forces the executor
onto a worker thread as torchgpipe always is, separating the inline-worker saving (see
executor.local.worker) from the rest.

    python3 benchmarks/executor_vs_torchgpipe.py --threads 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from autopipe.examples import get_example
from executor import GPipe
from executor.host_allocator import use_host_allocator

__all__ = ["Row", "flat_sequential", "measure", "main"]


@dataclass
class Row:
    model: str
    batch: int
    chunks: int
    recompute: str
    executor_ms: float
    threaded_ms: float  # executor forced onto a worker thread, as torchgpipe always is
    torchgpipe_ms: float
    max_grad_diff: float  # executor vs torchgpipe after the last step: the same work was timed

    @property
    def ratio(self) -> float:
        return self.executor_ms / self.torchgpipe_ms


def flat_sequential(
    name: str, batch: int
) -> tuple[nn.Sequential, Tensor, Tensor, Callable[..., Tensor]]:
    """A bundled example as one flat nn.Sequential (torchgpipe's only accepted form)."""
    ex = get_example(name, batch)
    children = dict(ex.model.named_children())
    if name == "mlp":
        seq = nn.Sequential(*children["net"].children())
    elif name == "cnn":
        seq = nn.Sequential(
            children["stem"],
            children["stem_relu"],
            *children["blocks"].children(),
            children["pool"],
            nn.Flatten(),
            children["head"],
        )
    else:
        raise ValueError(f"model {name!r} has no flat sequential form here; use mlp or cnn")
    return seq, ex.inputs[0], ex.target, ex.loss_fn


def _step(pipe: nn.Module, x: Tensor, target: Tensor, loss_fn: Callable[..., Tensor]) -> float:
    start = time.perf_counter()
    loss_fn(pipe(x), target).backward()
    return (time.perf_counter() - start) * 1e3


def measure(
    name: str, batch: int, chunks: int, recompute: str, repeats: int, warmup: int = 2
) -> Row:
    import torchgpipe

    seq, x, target, loss_fn = flat_sequential(name, batch)
    cut = len(seq) // 2
    balance = [cut, len(seq) - cut]
    ours_seq = copy.deepcopy(seq)
    ours = GPipe(
        [ours_seq[:cut], ours_seq[cut:]], ["cpu", "cpu"], chunks=chunks, recompute=recompute
    )
    threaded_seq = copy.deepcopy(seq)
    threaded = GPipe(
        [threaded_seq[:cut], threaded_seq[cut:]],
        ["cpu", "cpu"],
        chunks=chunks,
        recompute=recompute,
        threads=True,
    )
    peer = torchgpipe.GPipe(
        copy.deepcopy(seq),
        balance=balance,
        devices=["cpu", "cpu"],
        chunks=chunks,
        checkpoint=recompute,  # torchgpipe's own name for it
    )
    times: dict[str, list[float]] = {"ours": [], "threaded": [], "peer": []}
    for k in range(warmup + repeats):
        for key, pipe in (("ours", ours), ("threaded", threaded), ("peer", peer)):
            pipe.zero_grad(set_to_none=True)
            ms = _step(pipe, x, target, loss_fn)
            if k >= warmup:
                times[key].append(ms)
    diff = max(
        float((a.grad - b.grad).abs().max())
        for a, b in zip(ours.parameters(), peer.parameters(), strict=True)
        if a.grad is not None and b.grad is not None
    )
    return Row(
        name,
        batch,
        chunks,
        recompute,
        statistics.median(times["ours"]),
        statistics.median(times["threaded"]),
        statistics.median(times["peer"]),
        diff,
    )


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| model | batch | chunks | checkpoint | executor ms | executor (thread) ms "
        "| torchgpipe ms | ratio | ratio (thread) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.batch} | {r.chunks} | {r.recompute} | {r.executor_ms:.2f} "
            f"| {r.threaded_ms:.2f} | {r.torchgpipe_ms:.2f} | {r.ratio:.2f} "
            f"| {r.threaded_ms / r.torchgpipe_ms:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    use_host_allocator("retain")  # as the CLI does: [Note: freed memory stays in the process]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--checkpoints", nargs="+", default=["except_last", "never"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [
        measure(m, args.batch, c, mode, args.repeats)
        for m in args.models
        for c in args.chunks
        for mode in args.checkpoints
    ]
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats}\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
