"""Where the ranks of a torchrun launch run: the node flags checked, torchrun's flags for them.

    autopipe run mlp --plan plans/mlp.json --nproc 2                          # this host
    autopipe run mlp --plan plans/mlp.json --nproc 2 --nnodes 2 --node-rank R \\
        --rdzv-endpoint node0:29500                                           # on each of 2 hosts

[Note: one command line on every node] ``--nnodes 1`` (the default) runs ``torchrun
--standalone`` on this host. ``--nnodes N`` runs ``torchrun --nnodes N --nproc_per_node
nproc/N --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` instead, and the same command line is
run on every node: the torchruns meet at the endpoint and number the ranks themselves (c10d
sorts the nodes by address: which node runs stage 0 is torchrun's choice, not ``--node-rank``'s).
``--node-rank 0`` tells node 0 that it hosts the rendezvous (``--rdzv-conf is_host=true``, the
others ``false``); without it torchrun guesses by matching the endpoint's host to this host's
name and addresses, which fails where nodes share a hostname (containers, network namespaces).
``--local-addr`` is the address the others reach this node at: node 0's becomes every rank's
MASTER_ADDR (else its hostname, which on such hosts may resolve to another interface). Each
node checks the plan and config before its torchrun starts, and every rank then checks that
the others train the same config and plan (autopipe/app/rank_main.py): a node started with
another flag or plan file ends in one line, not a hang. ``--nproc`` counts the ranks of all
nodes, so a plan's rank count means the same on one host and on several.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopipe.errors import BuildError

if TYPE_CHECKING:
    from autopipe.app.config import Launch

__all__ = ["check_nodes", "endpoint", "rendezvous_args"]


def check_nodes(launch: Launch, nproc: int) -> None:
    """The node flags against each other and ``nproc`` ranks in all: one line per bad value."""
    n, node_rank, rdzv_endpoint, local_addr = launch.nnodes, launch.node_rank, launch.rdzv_endpoint, launch.local_addr
    if n < 1:
        raise BuildError(f"--nnodes {n} < 1: pass --nnodes 1 (this host) or the number of hosts")
    if n == 1:
        given = {"--node-rank": node_rank, "--rdzv-endpoint": rdzv_endpoint, "--local-addr": local_addr}
        for flag, value in given.items():
            if value is not None:
                raise BuildError(f"{flag} {value} without --nnodes: one host runs torchrun --standalone; "
                                 "pass --nnodes N (the number of hosts) with it, or leave it out")
        return
    if rdzv_endpoint is None:
        raise BuildError(f"--nnodes {n} needs --rdzv-endpoint HOST:PORT, an address of node 0 that every "
                         "node reaches, e.g. --rdzv-endpoint node0:29500")
    endpoint(rdzv_endpoint)
    if node_rank is not None and not 0 <= node_rank < n:
        raise BuildError(f"--node-rank {node_rank} is not a node of --nnodes {n}; pass 0 to {n - 1} (0 on "
                         "the node at --rdzv-endpoint)")
    if local_addr is not None and (not local_addr or any(c.isspace() or c == "/" for c in local_addr)):
        raise BuildError(f"--local-addr {local_addr!r} is not an address; pass this node's address or "
                         "name as the other nodes reach it, e.g. --local-addr 10.0.0.2")
    if nproc % n:
        raise BuildError(f"--nproc {nproc} ranks do not split evenly over --nnodes {n}; pass --nproc a "
                         f"multiple of {n} (the ranks of all nodes, the same number on each)")


def endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6 address]:PORT`` too) -> (host, port); one line when malformed."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ok = sep and host and not any(c.isspace() or c in "/[]" for c in host)
    if not ok or not port.isdigit() or not 0 < int(port) < 65536:
        raise BuildError(f"--rdzv-endpoint {text!r} is not HOST:PORT; pass node 0's address and a free "
                         "port there (1-65535), e.g. --rdzv-endpoint node0:29500")
    return host, int(port)


def rendezvous_args(launch: Launch, nproc: int) -> list[str]:
    """torchrun's flags that place ``nproc`` ranks in all ([Note: one command line on every node])."""
    check_nodes(launch, nproc)
    n = launch.nnodes
    if n == 1:
        return ["--standalone", f"--nproc_per_node={nproc}"]
    args = [f"--nnodes={n}", f"--nproc_per_node={nproc // n}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={launch.rdzv_endpoint}"]
    if launch.node_rank is not None:
        args.append(f"--rdzv-conf=is_host={'true' if launch.node_rank == 0 else 'false'}")
    if launch.local_addr is not None:
        args.append(f"--local-addr={launch.local_addr}")
    return args
