"""Tensor parallelism on ranks against one process, on meshes bigger than the test suite's.

    PYTHONPATH=$PWD python3 benchmarks/tp_mesh.py                      # TP 2 x PP 2 x DP 2: 8 ranks
    PYTHONPATH=$PWD python3 benchmarks/tp_mesh.py --dp 1 --stages 4 --schedule zbv
    PYTHONPATH=$PWD python3 benchmarks/tp_mesh.py --sequence-parallel         # sequence parallelism too

Runs one step of the bundled gpt (fused q/k/v, tied head) and a tiny HF Llama on
``tp x pp x dp`` gloo ranks ([Note: tensor parallelism on ranks]) and checks the loss and every
gradient against one process on the same micro-batches (tests/assemble/test_tensor_parallel.py
does the same on 4 ranks in the suite); prints one line per model with the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.forked_ranks import start_ranks


def _rank(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    from tests.assemble.test_tensor_parallel import _grads, replica_pipeline

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for case, plan in args["plans"].items():
            pipe, x, kw, y = replica_pipeline(case, rank, world, args["dp"], args["schedule"], plan, timeout=60)
            start = time.perf_counter()
            loss = pipe.step(*x, target=y, **kw)
            results[case] = {"loss": loss, "grads": _grads(pipe), "s": time.perf_counter() - start}
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out, f"{rank}.pt"))


def main(argv: list[str]) -> int:
    from tests.assemble.test_tensor_parallel import _plan, _reference
    from tests.forked import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--dp-mode", default="fsdp")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--sequence-parallel", action="store_true", help="split the norms by tokens too")
    a = parser.parse_args(argv)
    per_rank = 2 if a.schedule in ("interleaved1f1b", "interleaved_zb", "zbv", "dualpipev") else 1
    world = a.tp * a.stages // per_rank * a.dp
    plans = {case: dataclasses.replace(_plan(case, a.stages, a.dp, a.dp_mode, sp=a.sequence_parallel),
                                       tensor_parallel=a.tp).to_dict()
             for case in a.models.split(",")}
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        start_ranks(_rank, (world, free_port(), {"plans": plans, "dp": a.dp, "schedule": a.schedule}, out), world)
        wall = time.perf_counter() - start
        ranks = [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)]
    sp = ", split by tokens" if a.sequence_parallel else ""
    print(f"TP {a.tp}{sp} x PP {a.stages} stages ({a.schedule}) x DP {a.dp} ({a.dp_mode}) on {world} gloo ranks, "
          f"torch {torch.__version__}: {wall:.1f} s in all")
    ok = True
    for case in plans:
        ref_loss, ref_grads, _ = _reference(case, a.sequence_parallel)
        losses = [r[case]["loss"] for r in ranks if r[case]["loss"] is not None]
        loss = torch.stack(losses).mean()
        worst = max(float((g - ref_grads[k]).abs().max()) for r in ranks for k, g in r[case]["grads"].items())
        seen = {k for r in ranks for k in r[case]["grads"]}
        good = torch.allclose(loss, ref_loss) and worst < 1e-5 and seen == set(ref_grads)
        ok &= good
        step = max(r[case]["s"] for r in ranks)
        print(f"  {case:6s} loss {float(loss):.6f} (one process {float(ref_loss):.6f}), largest gradient "
              f"difference {worst:.2e}, every parameter: {seen == set(ref_grads)}, step {step:.2f} s: "
              f"{'equal' if good else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
