"""``autopipe comm --out FILE``: two ranks time the link between them, for ``profile --comm-from``.

    autopipe comm --out comm.json                                   # two ranks on this host
    autopipe comm --out comm.json --nnodes 2 --node-rank R \\
        --rdzv-endpoint node0:29500                                 # on each of two hosts
    autopipe profile mlp --comm-from comm.json --out profiles/mine/mlp.csv

``autopipe profile --comm`` spawns its two ranks on this host, so it measures loopback. Here
the two ranks are a torchrun launch ([Note: one command line on every node] in
autopipe/app/nodes.py), one on each node with ``--nnodes 2``: :func:`measure_link` starts
torchrun over this module, whose :func:`main` is one rank; the ranks take [Note: measured
transfer]'s measurements together (autopipe.frontend.profiling.spawned.comm.measure_comm_on_ranks) and
each node's first rank writes the result to ``--out`` (the same file on both nodes, written
whole or not at all). Its ranks' failures end in one line as ``autopipe run``'s do ([Note: one
line from K ranks] in autopipe/app/launch.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from autopipe.app.config import CommConfig
from autopipe.app.torchrun import launch_ranks, ranks_command
from autopipe.core.units import format_bytes
from autopipe.errors import AutopipeError, ProfileError

__all__ = ["measure_link", "main", "summary"]

RANK_TIMEOUT_S = 300  # how long a rank waits for the other: a slow link's 4 MiB crossings take seconds


def measure_link(config: CommConfig, *, log_dir: str | os.PathLike[str] | None = None,
                 extra_env: dict[str, str] | None = None, timeout: float | None = None) -> int:
    """Run ``config``'s two ranks under torchrun and print what they measured: 0 when
    ``config.out`` was written, 124 after ``timeout`` seconds; RankFailure (one line) when a rank
    failed. The ranks' and torchrun's logs are in ``log_dir`` (default: a new temporary one,
    removed after a measurement that left nothing to read there)."""
    out = Path(config.out).absolute()
    if out.exists() and not config.force:  # fail before launching
        raise ProfileError(f"{config.out} already exists: refusing to overwrite a link measurement; pass --force "
                           "or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)  # what is read back below is this launch's
    work = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="autopipe-comm-"))
    work.mkdir(parents=True, exist_ok=True)
    ranks = dataclasses.replace(config, out=str(out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    code = launch_ranks(ranks_command(ranks, 2, "autopipe.app.comm_job", work / "torchrun"), work,
                        2 // config.nnodes, nodes=config.nnodes, world=2, env=env, timeout=timeout,
                        temporary=log_dir is None)
    if code == 0:
        print(summary(json.loads(out.read_text(encoding="utf-8"))) + f"; wrote {config.out}")
    return code


def summary(measured: dict[str, object]) -> str:
    """One line: where the ranks ran, the fitted link and the runtime's cost per stage call."""
    nodes = measured.get("comm_nodes")
    where = "two ranks on 2 nodes" if nodes == 2 else "two ranks on this host"
    bandwidth = measured.get("comm_bandwidth")
    link = (f"{format_bytes(float(bandwidth))}/s" if isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth)
            else "no measurable bandwidth")
    return (f"between {where} ({measured.get('comm_backend')}): {measured.get('comm_latency_ms')} ms + bytes / "
            f"{link}; {measured.get('stage_call_fwd_ms')} + {measured.get('stage_call_bwd_ms')} ms per stage call")


def main(argv: Sequence[str] | None = None) -> int:
    """One of the two ranks (torchrun sets RANK, LOCAL_RANK and the rendezvous)."""
    import torch
    import torch.distributed as dist

    from autopipe.frontend.profiling.spawned.comm import measure_comm_on_ranks
    from executor.ranks.rank_cores import pin_local_rank

    parser = argparse.ArgumentParser(prog="autopipe.app.comm_job",
                                     description="one rank of `autopipe comm` (start it with torchrun)")
    parser.add_argument("--config", required=True, help="a CommConfig as JSON (autopipe comm writes it)")
    config = CommConfig.from_json(parser.parse_args(argv).config)
    if "RANK" not in os.environ:
        print("autopipe.app.comm_job: error: start me with torchrun (or `autopipe comm`)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:  # as `autopipe run` places its ranks, before gloo starts its threads
        pin_local_rank()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    try:
        measured = measure_comm_on_ranks(chunks=config.chunks, sizes=config.byte_sizes(), repeats=config.repeats)
        measured["comm_nodes"] = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one file per node, written whole
            out = Path(config.out)
            part = out.with_name(f".{out.name}.{os.getpid()}.part")
            part.write_text(json.dumps(measured, indent=1) + "\n", encoding="utf-8")
            os.replace(part, out)
        dist.barrier()
    except AutopipeError as err:
        print(f"autopipe comm: error on rank {dist.get_rank()}: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # a rank: [Note: a rank's imports without the collector] in autopipe/app/_startup.py
    from autopipe.app._startup import collector_paused, freeze_imports

    with collector_paused():
        import autopipe.frontend.profiling.spawned.comm  # noqa: F401 - what main() imports, imported here
    freeze_imports()
    raise SystemExit(main())
