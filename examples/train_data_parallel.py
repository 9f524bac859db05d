"""Train your own model as replicas of a pipeline: D data-parallel copies of a K-stage pipeline.

    torchrun --standalone --nproc_per_node 4 examples/train_data_parallel.py --data-parallel 2

The 4 ranks form a (dp, pp) mesh of 2 replicas x 2 stages: rank = replica x stages + stage.
Each replica trains its own share of every global batch (here its slice of one seeded batch;
for a dataset, a DistributedSampler with ``num_replicas=pipe.dp_size, rank=pipe.dp_rank``), the
stages of one replica pass
activations as in examples/train_distributed.py, and the D copies of each stage average their
gradients with DistributedDataParallel (``--dp-mode ddp``) or shard parameters, gradients and
optimizer state with FSDP2 (``--dp-mode fsdp``). Every rank steps its own optimizer over its own
stage. At the end each stage is saved ONCE, by replica 0 (under FSDP every rank takes part in
gathering the full tensors), and rank 0 merges the parts into one state_dict of the plain model,
which loads into a pipeline of any number of replicas, or none.
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


class Net(nn.Module):
    """Stand-in for your model: anything autopipe.trace can capture."""

    def __init__(self, dim: int = 128, depth: int = 4, classes: int = 10) -> None:
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
    p.add_argument("--data-parallel", type=int, default=2, help="replicas D (world = D x stages)")
    p.add_argument("--dp-mode", default="ddp", help="ddp | fsdp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="the global batch, split over replicas")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per replica's batch")
    p.add_argument("--out", default="checkpoints", help="where replica 0 saves each stage")
    args = p.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    d = args.data_parallel
    replica = rank // (world // d)  # the mesh's layout: rank = replica x stages + stage

    torch.manual_seed(0)  # the same model and global batch on every rank
    model = Net()
    x = torch.randn(args.batch_size, 32).tensor_split(d)[replica]  # this replica's rows
    y = torch.randint(0, 10, (args.batch_size,)).tensor_split(d)[replica]

    pipe = autopipe.distributed_pipeline(model, (x,), loss_fn=F.cross_entropy, chunks=args.chunks,
                                         data_parallel=d, dp_mode=args.dp_mode)
    assert (pipe.dp_rank, pipe.dp_size) == (replica, d)
    x, y = x.to(pipe.device), y.to(pipe.device)
    opt = torch.optim.AdamW(pipe.stage_module.parameters(), lr=1e-3)  # sharded under fsdp
    start = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad()
        loss = pipe.step(x, target=y)  # this replica's loss on its last stage, else None
        opt.step()
        if loss is not None:
            print(f"step {step + 1} replica {pipe.dp_rank}: loss {loss.item():.4f}", flush=True)
    if pipe.is_last and pipe.dp_rank == 0:
        print(f"{args.steps * args.batch_size / (time.perf_counter() - start):.0f} samples/s "
              f"({d} replicas x {pipe.pp_size} stages, {args.dp_mode})")

    state = pipe.state_dict()  # on every rank: under fsdp it gathers the shards
    os.makedirs(args.out, exist_ok=True)
    if pipe.dp_rank == 0:
        torch.save(state, os.path.join(args.out, f"stage{pipe.pp_rank}.pt"))
    dist.barrier()
    if rank == 0:
        plain = Net()
        parts = [os.path.join(args.out, f"stage{s}.pt") for s in range(pipe.pp_size)]
        plain.load_state_dict(autopipe.merge_state_dicts(parts, model=plain), strict=True)
        print(f"merged {pipe.pp_size} stage checkpoints into one state_dict of the plain model")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
