"""What each ``autopipe`` command takes: one frozen dataclass per command, every default here.

[Note: one place for defaults] The command line (cli.py) builds its flags from these fields,
``autopipe run`` hands its RunConfig to every rank as JSON (rank_main.py), and the library calls
read the config's fields. A default, a choice or a help text is therefore written once, and a
flag cannot drift from the rank-side parser or the library call it feeds. Choices are Literal
types (listed in each flag's help, checked by the library call in one line); ``help`` says
what a flag means and, where it has one, its default.

[Note: one chunks rule] ``--chunks`` (micro-batches per batch) and ``--batch-size`` default the
same way on every command: to the value the given plan (else profile) was made for, since a
plan or profile describes one micro-batch shape ([Note: graphs are keyed to the micro-batch]),
else to DEFAULT_CHUNKS = 4 and DEFAULT_BATCH = 32. :func:`resolve` applies the rule; each
``--help`` states it.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any, Literal

from autopipe.app.checkpoint_flags import CheckpointFlags, RestartFlags
from autopipe.app.flag_groups import (
    Checked,
    LoopFlags,
    MeshFlags,
    PrecisionFlags,
    check_choice,
    check_count,
    count_or_auto,
    flag,
    positional,
)
from autopipe.app.sheet_flags import EstimateFlags
from autopipe.errors import BuildError
from autopipe.frontend.profiling.defaults import DEFAULT_REPEATS, DEFAULT_WARMUP
from autopipe.solvers.defaults import ILP_TIME_LIMIT, SEARCH_ILP_TIME_LIMIT
from executor.spec import SCHEDULES

__all__ = [
    "ProfileConfig",
    "PartitionConfig",
    "SimulateConfig",
    "PlotConfig",
    "TrainConfig",
    "RunConfig",
    "CommConfig",
    "Launch",
    "DEFAULT_CHUNKS",
    "DEFAULT_BATCH",
    "DEFAULT_STAGES",
    "resolve",
]

Recompute = Literal["always", "except_last", "never"]
Method = Literal["auto", "exact", "ilp", "step", "uniform", "params", "blockpartition"]  # "dp": exact
Optimizer = Literal["none", "sgd", "momentum", "adam", "adamw"]
Ties = Literal["share", "colocate"]
Schedule = Literal["gpipe", "1f1b", "interleaved1f1b", "interleaved_zb", "zbv", "dualpipev"]
ScheduleChoice = Literal["gpipe", "1f1b", "interleaved1f1b", "interleaved_zb", "zbv", "dualpipev", "auto"]
Figure = Literal["balance", "timeline", "layers"]
ProfileMode = Literal["auto", "whole", "layers"]
assert typing.get_args(Schedule) == SCHEDULES, "--schedule's choices are executor.spec.SCHEDULES"

_EXAMPLE_MODEL = "bundled example (mlp, cnn, gpt, unet) or package.module:factory"
_TRAIN_MODEL = ("bundled example (mlp, cnn, gpt, unet) or package.module:factory returning "
                "(model, inputs, target, loss_fn) or an object with those attributes")
DEFAULT_CHUNKS = 4
DEFAULT_BATCH = 32
DEFAULT_STAGES = 2


def _chunks(made_for: str) -> str:
    """--chunks' help: [Note: one chunks rule], naming the inputs this command has."""
    return f"micro-batches per batch M (default: {made_for}, else {DEFAULT_CHUNKS})"


def _batch(made_for: str) -> str:
    return f"mini-batch size B (default: {made_for}, else {DEFAULT_BATCH})"


def resolve(value: int | None, *made_for: Any, default: int) -> int:
    """``value`` when given, else the first recorded value of the plan / profile it is used
    with, else ``default`` ([Note: one chunks rule])."""
    if value is not None:
        return value
    for recorded in made_for:
        if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 1:
            return recorded
    return default


@dataclass(frozen=True)
class ProfileConfig(PrecisionFlags, EstimateFlags):
    model: str = positional(_EXAMPLE_MODEL, metavar="MODEL")
    batch_size: int | None = flag(None, f"mini-batch size B (default {DEFAULT_BATCH}; a factory without a "
                                        f"batch_size parameter: its own inputs' batch)")
    chunks: int | None = flag(None, f"micro-batches per batch M; one micro-batch of ceil(B/M) rows is "
                                    f"profiled (default {DEFAULT_CHUNKS}; partition, train and run then "
                                    f"default to the profile's or plan's)")
    device: str = flag("cpu", "cpu | cuda | cuda:N (default cpu)")
    out: str | None = flag(None, "profiles/NAME.csv (default: from MODEL)")
    force: bool = flag(False, "overwrite --out if it exists")
    repeats: int | None = flag(None, f"timed runs per layer (default {DEFAULT_REPEATS})")
    warmup: int | None = flag(None, f"untimed runs first (default {DEFAULT_WARMUP})")
    max_depth: int | None = flag(None, "keep submodules at this depth whole")
    leaf: list[str] | None = flag(None, "submodule name or class to keep whole as one layer (repeatable)",
                                  metavar="NAME", action="append")
    input_shape: str | None = flag(None, "one sample's shape, e.g. 3,32,32, for a factory that "
                                         "returns a bare model (refused when it returns inputs)")
    threads: int | None = flag(None, "torch CPU threads while measuring")
    no_progress: bool = flag(False, "no progress bar on stderr")
    mode: ProfileMode = flag("auto", "whole: one run of the whole model on the device; layers: "
                                     "each layer alone (models that do not fit); auto: layers for "
                                     "a model on the meta device or larger than the device's free "
                                     "memory (default auto)")
    meta: bool = flag(False, "build the model on the meta device (no memory for its weights) and "
                             "profile it layer by layer")
    micro_batch_sizes: str | None = flag(None, "more micro-batch sizes to measure, e.g. 1,2,4,8, "
                                               "for `partition --chunks auto`")
    comm: bool = flag(False, "also measure a transfer between two ranks (latency, bandwidth), "
                             "the distributed runtime's cost per micro-batch and, on a CPU, how much "
                             "slower the model computes with a copy beside it, for plans run with "
                             "`autopipe run` on this host (10-20 s for the bundled examples)")
    comm_from: str | None = flag(None, "the link between two hosts as `autopipe comm` measured it "
                                       "(its --out FILE.json): its latency, bandwidth and call costs "
                                       "go into the profile instead of measuring this host's", metavar="FILE")


@dataclass(frozen=True)
class PartitionConfig(MeshFlags):
    profile: str = positional("profiles/NAME.csv (with NAME.json beside it)")
    stages: str | None = flag(None, "number of pipeline stages K, or auto: the fastest simulated "
                                    "iteration with up to one stage per --devices (default: one "
                                    "stage per --devices, per replica with --data-parallel)",
                              metavar="K|auto")
    devices: list[str] | None = flag(None, "the devices stages may use: a count N (N of the "
                                           "profiled kind) or names (cuda:0 cuda:1 ...); "
                                           "--stages auto needs it", nargs="+", metavar="DEVICE")
    method: Method = flag("auto", "partition method: exact (the DP over the topological order; "
                                  "dp is an alias), ilp (over the DAG), step (the shortest simulated "
                                  "step, not the smallest slowest stage), a baseline, or auto "
                                  "(default: exact, then the ILP only where a bound shows it can "
                                  "gain, then step where it steps faster)")
    memory: str | None = flag(None, "per-device memory limit, e.g. 16GiB")
    chunks: str | None = flag(None, _chunks("the profile's"), metavar="M|auto")
    batch_size: int | None = flag(None, "mini-batch size B: --chunks M plans micro-batches of "
                                        "ceil(B/M) rows, --chunks auto the fastest divisor M of B "
                                        "(default: the profile's)")
    recompute: str = flag("except_last", "recomputation: always, except_last, never, auto (a "
                                          "mode per stage, only where memory binds), or one mode "
                                          "per stage, comma-separated (default except_last)",
                           metavar="MODE|auto|M1,M2,..", renamed_from="--checkpoint")
    schedule: ScheduleChoice = flag("gpipe", "pipeline schedule, or auto: the fastest simulated "
                                             "(default gpipe)")
    optimizer: Optimizer = flag("adam", "optimizer whose state counts as memory (default adam)")
    ties: Ties = flag("share", "tied parameters: share or colocate (default share)")
    bandwidth: float | None = flag(None, "bytes/s between stages, 0 = free (default: the "
                                         "profile's measured by `profile --comm`, else 1e10)")
    time_limit: float | None = flag(None, f"ILP time limit in seconds, shown on its progress line "
                                          f"(default {ILP_TIME_LIMIT:g}; {SEARCH_ILP_TIME_LIMIT:g} in a "
                                          f"search with an auto choice)")
    out: str | None = flag(None, "plans/NAME.json to save the plan in (default: print it, save nothing)")
    force: bool = flag(False, "overwrite --out if it exists")
    no_progress: bool = flag(False, "no search or ILP progress on stderr (default: shown when "
                                    "stderr is a terminal)")

    def _check(self) -> None:  # the rest: partition()'s own one-line checks
        self.counts()

    def counts(self) -> tuple[int | str | None, int | str | None, int | str]:
        """--stages, --chunks and --data-parallel as numbers, "auto" or None (not given)."""
        return (None if self.stages is None else count_or_auto("--stages", self.stages),
                None if self.chunks is None else count_or_auto("--chunks", self.chunks),
                count_or_auto("--data-parallel", self.data_parallel))

    def recompute_modes(self) -> str | list[str]:
        """--recompute as one mode (or auto) or, comma-separated, a list of one per stage."""
        return self.recompute.split(",") if "," in self.recompute else self.recompute

    def partition_args(self, meta: dict[str, Any]) -> dict[str, Any]:
        """partition()'s keywords for a profile of metadata ``meta`` ([Note: one chunks rule];
        ``--bandwidth`` absent: the profile's measured one, 0: free)."""
        stages, chunks, data_parallel = self.counts()
        return dict(
            stages=stages, devices=self.device_names(meta.get("device_type")), method=self.method,
            chunks=chunks if chunks is not None else resolve(None, meta.get("chunks"), default=DEFAULT_CHUNKS),
            dp_mode=self.dp_mode,
            recompute=self.recompute_modes(), schedule=self.schedule, batch_size=self.batch_size,
            memory_limit=self.memory, optimizer=self.optimizer, time_limit=self.time_limit, ties=self.ties,
            bandwidth="measured" if self.bandwidth is None else self.bandwidth or None,
            progress=False if self.no_progress else None, data_parallel=data_parallel,
            tensor_parallel=count_or_auto("--tensor-parallel", self.tensor_parallel),
            sequence_parallel=self.sequence_parallel, devices_per_host=self.devices_per_host)

    def device_names(self, profiled_kind: str | None) -> list[str] | None:
        """--devices: the names given, or ``--devices N`` as N devices of the profiled kind."""
        devices = self.devices
        if devices is not None and len(devices) == 1 and devices[0].isdigit():
            count = count_or_auto("--devices", devices[0])
            return [f"{profiled_kind or 'stage'}:{s}" for s in range(count if isinstance(count, int) else 0)]
        return devices


@dataclass(frozen=True)
class SimulateConfig:
    plan: str = positional("plans/NAME.json")
    profile: str | None = flag(None, "profiles/NAME.csv to recompute stage costs from")
    schedule: Schedule | None = flag(None, "schedule to simulate (default: the plan's)")


@dataclass(frozen=True)
class PlotConfig:
    plan: str = positional("plans/NAME.json")
    profile: str | None = flag(None, "profiles/NAME.csv: check the plan against it and recompute "
                                     "stage costs from it (needed by --layers)")
    figure: Figure = flag("balance", "which figure", switches={
        "--timeline": ("timeline", "the simulated pipeline timeline instead of the balance bars"),
        "--layers": ("layers", "per-layer time and memory with the plan's cuts (needs --profile)"),
    })
    schedule: Schedule | None = flag(None, "schedule of --timeline (default: the plan's)")
    out: str = flag(None, "image file: .png, .svg or .pdf", required=True)
    force: bool = flag(False, "overwrite --out if it exists")


@dataclass(frozen=True)
class TrainConfig(CheckpointFlags, PrecisionFlags, LoopFlags):
    model: str = positional(_TRAIN_MODEL, metavar="MODEL")
    stages: int | None = flag(None, f"pipeline stages K (default: the plan's, else one per --devices, "
                                    f"else {DEFAULT_STAGES})")
    chunks: int | None = flag(None, _chunks("the --plan's, else the --profile's"))
    batch_size: int | None = flag(None, _batch("the --plan's, else the --profile's"))
    recompute: Recompute | None = flag(None, "recomputation (default: the plan's, per stage, "
                                               "else except_last)", renamed_from="--checkpoint")
    devices: list[str] | None = flag(None, "one device per stage (default: cpu for every stage)", nargs="+")
    method: Method = flag("auto", "partition method (default auto)")
    plan: str | None = flag(None, "use this saved plan instead of partitioning")
    profile: str | None = flag(None, "use this saved profile instead of measuring")



_Launch = typing.TypeVar("_Launch", bound="Launch")


@dataclass(frozen=True, kw_only=True)
class Launch(Checked):
    """What the torchrun launches of ``autopipe run`` and ``autopipe comm`` share: where the ranks
    run, this host (``torchrun --standalone``) or ``nnodes`` hosts meeting at ``rdzv_endpoint``
    and each running the same command line ([Note: one command line on every node] in
    autopipe/app/nodes.py), and the config reaching every rank as JSON."""

    nnodes: int = flag(1, "hosts, each running this same command line (default 1: this host alone, "
                          "torchrun --standalone)")
    node_rank: int | None = flag(None, "this host's number 0..N-1 with --nnodes N: node 0 hosts the "
                                       "rendezvous at --rdzv-endpoint (default: torchrun's guess, "
                                       "the endpoint's host matching this host's name or addresses)")
    rdzv_endpoint: str | None = flag(None, "with --nnodes: HOST:PORT of node 0 that every node "
                                           "reaches (torchrun's c10d rendezvous)", metavar="HOST:PORT")
    local_addr: str | None = flag(None, "with --nnodes: the address the other nodes reach this one "
                                        "at (default: this host's name)", metavar="ADDR")

    def check_nodes(self, nproc: int) -> None:
        """The node flags against each other and ``nproc`` ranks in all: one line per bad value."""
        from autopipe.app.nodes import check_nodes

        check_nodes(self, nproc)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls: type[_Launch], text: str) -> _Launch:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class RunConfig(Launch, RestartFlags, PrecisionFlags, LoopFlags):
    """What every rank of ``autopipe run`` trains: a model, a plan (the launcher makes one when
    none is given) and the loop. Travels to the ranks as JSON (:meth:`to_json`), resolved."""

    model: str = positional(_TRAIN_MODEL, metavar="MODEL")
    plan: str | None = flag(None, "plans/NAME.json (default: profile and partition before starting the ranks)")
    nproc: int = flag(2, "processes = replicas x pipeline ranks (default 2)")
    batch_size: int | None = flag(None, _batch("the --plan's"))
    chunks: int | None = flag(None, _chunks("the --plan's"))
    schedule: Schedule | None = flag(None, "pipeline schedule (default: the plan's, else gpipe)")
    recompute: Recompute | None = flag(None, "recomputation (default: the plan's, else except_last)",
                                       renamed_from="--checkpoint")
    timeout: float = flag(60.0, "seconds a step may take before a silent rank is an error and the "
                                "watchdog ends the rank (exit 3) (default 60)")
    first_step_timeout: float = flag(600.0, "the same for the first step, which builds, warms up "
                                            "and may compile (default 600)")
    threads: int = flag(1, "torch threads per rank (default 1)")
    no_pin_cores: bool = flag(False, "on a CPU, leave the ranks to the OS scheduler (default: local rank r "
                                     "of n runs on the r-th n-th of this process's cores)")
    data_parallel: str | None = flag(None, "replicas D of the pipeline, each on --nproc / D ranks and "
                                           "--batch-size / D rows, or auto (without --plan): the "
                                           "planner picks D (default: the --plan's, else 1)",
                                     metavar="D|auto")
    dp_mode: Literal["ddp", "fsdp"] | None = flag(None, "how replicas sync: ddp (gradient all-reduce) "
                                                        "or fsdp (sharded state) (default: the "
                                                        "--plan's, else ddp)")

    def replicas(self) -> int | str | None:
        """--data-parallel as a number, "auto" or None (the plan's); one line when malformed."""
        d = self.data_parallel
        if d is None or d == "auto":
            return d
        if not d.isdigit() or int(d) < 1:
            raise BuildError(f"--data-parallel {d!r} is not a number of replicas; pass an integer "
                             ">= 1 or auto")
        return int(d)

    def _check(self) -> None:
        """The flags alone (before any file is read): one line per bad value; the groups'
        own checks ran first ([Note: flags checked when made] in flag_groups.py)."""
        if ":" not in self.model:
            from autopipe.examples import EXAMPLES

            if self.model not in EXAMPLES:
                raise BuildError(f"unknown example {self.model!r}; `autopipe run` trains one of "
                                 f"{sorted(EXAMPLES)} or a 'package.module:factory'")
        if self.nproc < 1:
            raise BuildError(f"--nproc {self.nproc} < 1: a pipeline needs at least one process")
        check_count("--batch-size", self.batch_size)
        check_count("--chunks", self.chunks)
        check_count("--threads", self.threads)
        if not self.timeout > 0:
            raise BuildError(f"--timeout {self.timeout} must be > 0 seconds, e.g. --timeout 60")
        if not self.first_step_timeout > 0:
            raise BuildError(f"--first-step-timeout {self.first_step_timeout} must be > 0 seconds, "
                             "e.g. --first-step-timeout 600")
        if self.schedule is not None:
            check_choice("--schedule", self.schedule, Schedule)
        if self.recompute is not None:
            check_choice("--recompute", self.recompute, Recompute)
        if self.dp_mode is not None:
            check_choice("--dp-mode", self.dp_mode, Literal["ddp", "fsdp"])
        self.check_nodes(self.nproc)
        if self.nnodes > 1 and self.plan is None:
            raise BuildError(f"--nnodes {self.nnodes} without --plan: each node would profile and partition "
                             "on its own, into plans that can differ; make one (`autopipe partition PROFILE "
                             "--stages K --out plans/NAME.json`) and pass --plan with a copy on every node")
        replicas = self.replicas()
        if isinstance(replicas, int) and self.nproc % replicas:
            raise BuildError(f"--nproc {self.nproc} does not split into --data-parallel {replicas} "
                             f"replicas; pass --nproc a multiple of {replicas} (replicas x stages)")


@dataclass(frozen=True)
class CommConfig(Launch):
    """``autopipe comm``: two ranks time the link between them (both on this host, or one on each
    of two nodes) and write what ``profile --comm-from`` reads ([Note: measured transfer])."""

    out: str = flag(None, "FILE.json to write, on every node", required=True)
    force: bool = flag(False, "overwrite --out if it exists")
    sizes: str = flag("64,65536,524288,4194304", "bytes per crossing to time, 2 or more sizes; each "
                                                 "takes about 3 x (repeats + 3) x size / bandwidth "
                                                 "(default 64,65536,524288,4194304)", metavar="B1,B2,..")
    repeats: int = flag(20, "timed crossings per size (default 20)")
    chunks: int = flag(DEFAULT_CHUNKS, f"micro-batches of the empty pipelines that time the runtime's "
                                       f"own cost per stage call (default {DEFAULT_CHUNKS})")

    def byte_sizes(self) -> list[int]:
        """--sizes as numbers, checked: one line when malformed."""
        parts = self.sizes.split(",")
        if len(parts) < 2 or not all(x.isdigit() and int(x) >= 4 for x in parts) or len(set(parts)) < len(parts):
            raise BuildError(f"--sizes {self.sizes!r}: give 2 or more different byte counts >= 4, comma-"
                             "separated, e.g. 64,65536,1048576")
        return [int(x) for x in parts]

    def _check(self) -> None:
        if self.nnodes > 2:
            raise BuildError(f"--nnodes {self.nnodes}: the link is timed by two ranks, both on this host "
                             "(--nnodes 1) or one on each of two (--nnodes 2)")
        self.check_nodes(2)
        self.byte_sizes()
        check_count("--repeats", self.repeats)
        check_count("--chunks", self.chunks)



