"""Checkpoints: save and load time and size against torch.save / torch.load of the whole
state_dict, and how long an async save blocks training, in one process and on 2 gloo ranks.

    python3 benchmarks/checkpoint.py                            # both runtimes
    python3 benchmarks/checkpoint.py --tiny --runtimes one      # seconds (the test)

The model is the bundled GPT (autopipe.examples.TinyGPT, its head tied to its embedding) at
the size given, with AdamW (two state tensors per parameter, all created by one step first),
split into 2 stages (a uniform plan made once here, from a made-up profile: no profiling):

- one process: executor.GPipe of both stages (``autopipe.pipeline``); the baseline is
  ``torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, file)`` (also with an
  ``os.fsync`` of the file: DCP's writer fsyncs each file it writes) and ``torch.load`` +
  ``load_state_dict`` of both, against ``pipe.save_checkpoint`` / ``pipe.load_checkpoint``
  (torch.distributed.checkpoint keyed by the plain model's names, executor/checkpoint/);
- 2 ranks (``distributed_pipeline``, gloo, one thread each): each rank's baseline is its own
  stage's state_dict and optimizer in its own file; the checkpoint is one collective. A row's
  time per repeat is the slower rank's, each rank timed from a barrier;
- async overlap: ``--steps`` training steps (forward, backward, AdamW) with a save after the
  first, and the handle waited for after the last: the loop's time minus the same repeat's
  loop without a save (the three loops take turns in each repeat) is what the save cost
  training ("blocked"), synchronous vs async (whose call returns once the state is copied).

Times are medians of ``--repeats`` with min-max; sizes are the bytes on disk. Loads read what
the save just wrote, from the page cache: the figures are the formats' and the code's costs,
not the disk's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.spawn import start_processes

import autopipe
from autopipe.core.plan import Plan
from autopipe.examples import TinyGPT
from autopipe.frontend.profiling.spawned.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, run or imported
from precision import environment  # noqa: E402 - after the path it is found on

__all__ = ["Row", "Overlap", "main"]

RUNTIMES = ("one", "ranks")
TINY = {"vocab": 64, "dim": 32, "layers": 2, "seq": 8, "batch": 4, "repeats": 2, "steps": 3}
SAVES = ("torch.save", "torch.save + fsync", "save_checkpoint")
LOADS = ("torch.load", "load_checkpoint")


@dataclass(frozen=True)
class Size:
    vocab: int
    dim: int
    layers: int
    seq: int
    batch: int


@dataclass
class Row:
    """One way to save or load, in one runtime: its times (ms, one per repeat) and bytes."""

    runtime: str  # "one process" | "2 ranks"
    what: str  # one of SAVES or LOADS
    times: list[float]
    size: int  # bytes on disk (every rank's together)
    baseline: Row | None = None  # torch.save / torch.load in the same runtime

    @property
    def ms(self) -> float:
        return statistics.median(self.times)

    @property
    def ratio(self) -> float | None:
        return None if self.baseline is None else self.ms / self.baseline.ms


@dataclass
class Overlap:
    """The training loop with a save after its first step: ``loop`` (ms per repeat) against
    the same loop without one (``none``); ``call``: how long save_checkpoint took to return."""

    runtime: str
    mode: str  # "sync" | "async"
    loop: list[float]
    none: list[float]
    call: list[float]

    @property
    def blocked_each(self) -> list[float]:
        """Per repeat, the loop's ms minus the same repeat's loop without a save."""
        return [loop - none for loop, none in zip(self.loop, self.none, strict=True)]

    @property
    def blocked(self) -> float:
        return statistics.median(self.blocked_each)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _model(size: Size) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=size.vocab, dim=size.dim, heads=4, layers=size.layers, max_len=size.seq)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq))
    return model, ids, torch.randint(0, size.vocab, (size.batch, size.seq))


def _plan(size: Size) -> dict[str, Any]:
    """A uniform 2-stage plan from made-up layer costs (the split is all that is used)."""
    import pandas as pd

    from autopipe.assemble.setup import microbatch_inputs
    from autopipe.core.profile_table import Profile
    from autopipe.frontend.tracing.graph import trace
    from autopipe.solvers.partitioner import partition

    model, ids, _ = _model(size)
    graph = trace(model, microbatch_inputs((ids,), 2))
    nodes = [graph.nx.nodes[n] for n in graph.layers]
    frame = pd.DataFrame({"layer": graph.layers, "fwd_ms": 1.0, "bwd_ms": 2.0,
                          "param_bytes": [n["param_bytes"] for n in nodes],
                          "output_bytes": [n["output_bytes"] for n in nodes],
                          "saved_bytes": [n["output_bytes"] for n in nodes]})
    profile = Profile.from_frame(frame, edges=graph.edges(), meta={"fingerprint": graph.fingerprint})
    return partition(profile, stages=2, method="uniform", chunks=2).to_dict()


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


class _Bench:
    """One runtime's pipeline, optimizer and the timings of each way to save and load."""

    def __init__(self, size: Size, plan: dict[str, Any], root: Path, rank: int | None) -> None:
        model, self.ids, self.target = _model(size)
        made = Plan.from_dict(plan)
        self.rank, self.root = rank, root
        if rank is None:
            with warnings.catch_warnings():  # that the plan was made for other devices: its split is all
                warnings.simplefilter("ignore", UserWarning)
                self.pipe: Any = autopipe.pipeline(model, (self.ids,), devices=["cpu", "cpu"],
                                                   loss_fn=_lm_loss, plan=made)
            self.module: torch.nn.Module = model
        else:
            from autopipe.assemble.ranks import distributed_pipeline

            self.pipe = distributed_pipeline(model, (self.ids,), loss_fn=_lm_loss, plan=made, timeout=600)
            self.module = self.pipe.stage_module
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.step()  # AdamW's state exists, as in a checkpoint of a run

    def step(self) -> None:
        self.opt.zero_grad()
        if self.rank is None:
            self.pipe(self.ids, target=self.target).backward()
        else:
            self.pipe.step(self.ids, target=self.target)
        self.opt.step()

    def _sync(self) -> None:
        if self.rank is not None:
            dist.barrier()

    def timed(self, fn: Callable[[], Any]) -> float:
        """``fn``'s ms on this rank, from a barrier of all ranks."""
        self._sync()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def _file(self) -> Path:
        return self.root / f"whole-{self.rank or 0}.pt"

    def _torch_save(self, fsync: bool) -> None:
        with open(self._file(), "wb") as f:
            torch.save({"model": self.module.state_dict(), "optim": self.opt.state_dict()}, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    def _torch_load(self) -> None:
        whole = torch.load(self._file(), weights_only=True)
        self.module.load_state_dict(whole["model"])
        self.opt.load_state_dict(whole["optim"])

    def saves_and_loads(self, repeats: int) -> dict[str, tuple[list[float], int]]:
        out: dict[str, tuple[list[float], int]] = {}
        ckpt = self.root / "ckpt"
        ways: dict[str, Callable[[], Any]] = {
            "torch.save": lambda: self._torch_save(False), "torch.save + fsync": lambda: self._torch_save(True),
            "save_checkpoint": lambda: self.pipe.save_checkpoint(ckpt, self.opt, step=1),
            "torch.load": self._torch_load, "load_checkpoint": lambda: self.pipe.load_checkpoint(ckpt, self.opt)}
        for what, fn in ways.items():
            times = []
            for _ in range(repeats):
                if what in SAVES:  # each save writes afresh (untimed: removing the last one's)
                    self._sync()
                    if what != "save_checkpoint":
                        self._file().unlink(missing_ok=True)
                    elif self.rank in (None, 0):
                        shutil.rmtree(ckpt, ignore_errors=True)
                times.append(self.timed(fn))
            self._sync()
            where = ckpt if what.endswith("_checkpoint") else self._file()
            out[what] = (times, _folder_bytes(where) if self.rank in (None, 0) or where == self._file() else 0)
        return out

    def _loop(self, steps: int, mode: str, folder: Path) -> tuple[float, float | None]:
        """``steps`` training steps, a save in ``mode`` after the first, waited for after the
        last: the loop's ms (from a barrier) and the save call's."""
        self._sync()
        start, call, saving = time.perf_counter(), None, None
        for i in range(steps):
            self.step()
            if i == 0 and mode != "none":
                called = time.perf_counter()
                saving = self.pipe.save_checkpoint(folder, self.opt, async_save=mode == "async")
                call = (time.perf_counter() - called) * 1e3
        if saving is not None:
            saving.wait()
        return (time.perf_counter() - start) * 1e3, call

    def overlap(self, steps: int, repeats: int) -> dict[str, tuple[list[float], list[float]]]:
        """Per mode: the loop's ms and the save call's ms, one per repeat; the modes take turns
        within each repeat, so that the machine's drift reaches all three alike."""
        out: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in ("none", "sync", "async")}
        folder = self.root / "overlap"
        for _ in range(repeats):
            for mode, (loops, calls) in out.items():
                loop, call = self._loop(steps, mode, folder)
                loops.append(loop)
                calls += [] if call is None else [call]
                self._sync()
                if self.rank in (None, 0):
                    shutil.rmtree(folder, ignore_errors=True)
        return out


def _measure(size: Size, plan: dict[str, Any], root: Path, rank: int | None, repeats: int,
             steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    bench = _Bench(size, plan, root, rank)
    return {"io": bench.saves_and_loads(repeats), "overlap": bench.overlap(steps, repeats)}


def _rank(rank: int, port: int, out: str, size: Size, plan: dict[str, Any], repeats: int, steps: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=600))
    result = _measure(size, plan, Path(out), rank, repeats, steps)
    torch.save(result, Path(out) / f"result-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _rows(runtime: str, parts: Sequence[dict[str, Any]]) -> tuple[list[Row], list[Overlap]]:
    """Rows from each rank's results: per repeat the slower rank's time, bytes summed."""
    rows: dict[str, Row] = {}
    for what in (*SAVES, *LOADS):
        times = [max(ts) for ts in zip(*(p["io"][what][0] for p in parts), strict=True)]
        rows[what] = Row(runtime, what, times, sum(p["io"][what][1] for p in parts))
    for what in (*SAVES[1:], *LOADS[1:]):
        rows[what].baseline = rows[SAVES[0] if what in SAVES else LOADS[0]]

    def slowest(mode: str, k: int) -> list[float]:
        return [max(ts) for ts in zip(*(p["overlap"][mode][k] for p in parts), strict=True)]

    overlaps = [Overlap(runtime, mode, slowest(mode, 0), slowest("none", 0), slowest(mode, 1))
                for mode in ("sync", "async")]
    return list(rows.values()), overlaps


def measure(size: Size, runtimes: Sequence[str], repeats: int, steps: int,
            root: Path) -> tuple[list[Row], list[Overlap]]:
    plan = _plan(size)
    rows: list[Row] = []
    overlaps: list[Overlap] = []
    if "one" in runtimes:
        with tempfile.TemporaryDirectory(dir=root) as out:
            r, o = _rows("one process", [_measure(size, plan, Path(out), None, repeats, steps)])
        rows, overlaps = rows + r, overlaps + o
    if "ranks" in runtimes:
        with tempfile.TemporaryDirectory(dir=root) as out:
            start_processes(_rank, args=(free_port(), out, size, plan, repeats, steps), nprocs=2,
                            start_method="spawn")
            r, o = _rows("2 ranks", [torch.load(Path(out) / f"result-{k}.pt") for k in range(2)])
        rows, overlaps = rows + r, overlaps + o
    return rows, overlaps


def _spread(times: Sequence[float]) -> str:
    return f"{min(times):.1f}-{max(times):.1f}"


def table(rows: Sequence[Row]) -> str:
    lines = ["| runtime | how | ms | min-max | / torch.save or torch.load | MiB on disk | / torch.save's |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = r.baseline
        lines.append(f"| {r.runtime} | {r.what} | {r.ms:.1f} | {_spread(r.times)} | "
                     f"{'-' if r.ratio is None else f'{r.ratio:.2f}'} | {r.size / 2**20:.1f} | "
                     f"{'-' if base is None else f'{r.size / base.size:.2f}'} |")
    return "\n".join(lines)


def overlap_table(overlaps: Sequence[Overlap]) -> str:
    lines = ["| runtime | save | loop ms | min-max | loop ms without a save | blocked ms | min-max | "
             "save call ms | blocked / sync's |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for o in overlaps:
        sync = next(s for s in overlaps if s.runtime == o.runtime and s.mode == "sync")
        lines.append(f"| {o.runtime} | {o.mode} | {statistics.median(o.loop):.1f} | {_spread(o.loop)} | "
                     f"{statistics.median(o.none):.1f} | {o.blocked:.1f} | {_spread(o.blocked_each)} | "
                     f"{statistics.median(o.call):.1f} | {o.blocked / sync.blocked:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> tuple[list[Row], list[Overlap]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES,
                        help="one: executor.GPipe in this process; ranks: 2 gloo ranks")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=6, help="training steps per overlap loop")
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temp folder)")
    parser.add_argument("--tiny", action="store_true", help="a model of a few thousand parameters, 2 repeats")
    parser.add_argument("--note", default="", help="added to the environment line (the machine's load)")
    args = parser.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
    torch.set_num_threads(1)
    size = Size(args.vocab, args.dim, args.layers, args.seq, args.batch)
    rows, overlaps = measure(size, args.runtimes, args.repeats, args.steps,
                             Path(args.dir or tempfile.gettempdir()))
    params = sum(p.numel() for p in _model(size)[0].parameters())
    print(f"GPT vocab {size.vocab}, dim {size.dim}, {size.layers} layers ({params / 1e6:.1f} M parameters, "
          f"AdamW), seq {size.seq}, batch {size.batch}, 2 stages, 1 thread per process; {args.repeats} "
          f"repeats, {args.steps} steps per overlap loop")
    print(environment(args.note))
    print()
    print(table(rows))
    print()
    print(overlap_table(overlaps))
    return rows, overlaps


if __name__ == "__main__":
    main()
