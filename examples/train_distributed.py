"""Train your own model as a multi-process pipeline: one process per stage, started by torchrun.

    torchrun --standalone --nproc_per_node 2 examples/train_distributed.py --steps 20

Every rank runs this same script: it builds the same model (same seed), joins the process
group, and lets autopipe trace, partition (on rank 0, broadcast to all) and cut the model; each
rank keeps only its own stage and steps an optimizer over it. Pass ``--plan plans/NAME.json``
to use a saved plan (``autopipe profile`` + ``autopipe partition --stages K``) instead.
At the end each rank saves its stage under the original model's keys, and rank 0 merges the
parts into one state_dict that loads into the plain, unpipelined model.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import autopipe
import executor


class Net(nn.Module):
    """Stand-in for your model: anything autopipe.trace can capture."""

    def __init__(self, dim: int = 256, depth: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(32, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(depth)
        )
        self.out = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)  # residuals: values cross the pipeline's cuts
        return self.out(h)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--schedule", default="gpipe", help="gpipe | 1f1b | interleaved1f1b")
    p.add_argument("--plan", default=None, help="plans/NAME.json made for this model")
    p.add_argument("--out", default="checkpoints", help="where each rank saves its stage")
    args = p.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        cores = None
    else:  # ranks sharing a CPU host: each on its own share of the cores, before gloo's threads start
        cores = executor.pin_local_rank()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(len(cores) if cores else max(1, (os.cpu_count() or 1) // world))

    torch.manual_seed(0)  # the same model and data on every rank
    model = Net()
    x = torch.randn(args.batch_size, 32)
    y = torch.randint(0, 10, (args.batch_size,))

    plan = autopipe.Plan.load(args.plan) if args.plan else None
    pipe = autopipe.distributed_pipeline(model, (x,), loss_fn=F.cross_entropy, plan=plan,
                                         chunks=args.chunks, schedule=args.schedule)
    x, y = x.to(pipe.device), y.to(pipe.device)
    opt = torch.optim.AdamW(pipe.stage_module.parameters(), lr=1e-3)
    start = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad()
        loss = pipe.step(x, target=y)  # the mean micro-batch loss on the last rank, else None
        opt.step()
        if loss is not None:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    if pipe.is_last:
        print(f"{args.steps * args.batch_size / (time.perf_counter() - start):.0f} samples/s")

    os.makedirs(args.out, exist_ok=True)
    torch.save(pipe.state_dict(), os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        plain = Net()
        parts = [os.path.join(args.out, f"rank{r}.pt") for r in range(world)]
        plain.load_state_dict(autopipe.merge_state_dicts(parts, model=plain))
        print(f"merged {world} stage checkpoints into one state_dict of the plain model")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
