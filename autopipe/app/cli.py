"""The ``autopipe`` command line: argv -> config -> one library call. No logic lives here.

    autopipe profile MODEL ...       measure a model's layers         (app.profile_job)
    autopipe partition PROFILE ...   balance the layers into stages   (solvers.partitioner)
    autopipe simulate PLAN ...       predict the pipeline's timeline  (core.simulator)
    autopipe plot PLAN ...           draw balance / timeline figures  (plot)
    autopipe train EXAMPLE ...       the whole job in one process     (app.train)
    autopipe run MODEL ...           train with torchrun              (app.launch, app.rank_main)
    autopipe comm --out FILE ...     time the link between two ranks  (app.comm_job)
    autopipe calibrate --device DEV  this device into a device sheet  (app.calibrate_job)

Flags, choices and defaults come from the config dataclasses in autopipe.app.config.

Every AutopipeError (a ValueError subclass with a one-line message saying what to do), and the
runtime's ExecutorError (e.g. a checkpoint of another model), is printed as
``autopipe: error: ...`` and the exit status is 2; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from autopipe.app.config import (
    CommConfig,
    PartitionConfig,
    PlotConfig,
    ProfileConfig,
    RunConfig,
    SimulateConfig,
    TrainConfig,
)
from autopipe.app.flags import add_arguments, from_namespace
from autopipe.app.sheet_flags import CalibrateConfig
from autopipe.errors import AutopipeError
from executor.errors import ExecutorError

__all__ = ["main", "build_parser"]

# Each subcommand module-level function registers its parser and returns nothing; the handler
# is stored as the ``func`` default on the subparser and receives the parsed namespace.
Handler = Callable[[argparse.Namespace], int]
_REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = []  # type: ignore[type-arg]


def _register(fn: Callable[[argparse._SubParsersAction], None]) -> Callable[[argparse._SubParsersAction], None]:  # type: ignore[type-arg]
    _REGISTRARS.append(fn)
    return fn


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopipe", description="GPipe done automatically: profile, partition, run."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for registrar in _REGISTRARS:
        registrar(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.func
    try:
        return handler(args)
    except (AutopipeError, ExecutorError) as err:  # the runtime's bad input too (a checkpoint's)
        print(f"autopipe: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"autopipe: error: {err.filename or err}: no such file", file=sys.stderr)
        return 2


# --- subcommands -------------------------------------------------------------------------------
# Each subcommand is a ``@_register``-decorated function that adds a subparser built from its
# config dataclass (autopipe.app.config) and a handler that makes one library call.


def _command(sub: argparse._SubParsersAction, name: str, config: type, handler: Handler,  # type: ignore[type-arg]
             help: str) -> None:
    p = sub.add_parser(name, help=help, description=help)
    add_arguments(p, config)
    p.set_defaults(func=handler)


@_register
def _profile_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _command(sub, "profile", ProfileConfig, _profile, "measure a model's layers into profiles/NAME.csv")


def _profile(args: argparse.Namespace) -> int:
    from autopipe.app.profile_job import profile_to_file, summary_table

    config: ProfileConfig = from_namespace(ProfileConfig, args)
    prof, path = profile_to_file(
        config.model, out=config.out, force=config.force, batch_size=config.batch_size,
        chunks=config.chunks, device=config.device, repeats=config.repeats, warmup=config.warmup,
        max_depth=config.max_depth, leaf=config.leaf, input_shape=config.input_shape,
        threads=config.threads, progress=not config.no_progress, mode=config.mode,
        meta=config.meta, micro_batch_sizes=config.micro_batch_sizes, comm=config.comm,
        comm_from=config.comm_from, host_allocator=config.host_allocator, precision=config.precision,
        estimate=config.estimate,
    )
    print(summary_table(prof, where=path))
    print(f"wrote {path} and {path.with_suffix('.json')}")
    return 0


@_register
def _calibrate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _command(sub, "calibrate", CalibrateConfig, _calibrate,
             "measure this device (matmuls, attention, elementwise) into a device sheet for --estimate")


def _calibrate(args: argparse.Namespace) -> int:
    from autopipe.app.calibrate_job import calibrate_to_file, sheet_summary

    sheet, path = calibrate_to_file(from_namespace(CalibrateConfig, args))
    print(sheet_summary(sheet))
    print(f"wrote {path}; estimate on it with: autopipe profile MODEL --estimate {path}")
    return 0


@_register
def _partition_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _command(sub, "partition", PartitionConfig, _partition,
             "balance a profile's layers into pipeline stages")


def _partition(args: argparse.Namespace) -> int:
    from autopipe.core.plan import Plan
    from autopipe.core.profile_table import Profile
    from autopipe.errors import PlanError
    from autopipe.solvers.partitioner import partition

    config: PartitionConfig = from_namespace(PartitionConfig, args)
    if config.out is not None and os.path.exists(config.out) and not config.force:  # fail before solving
        raise PlanError(f"{config.out} already exists: refusing to overwrite a saved plan; pass --force")
    profile = Profile.load(config.profile)
    plan: Plan = partition(profile, **config.partition_args(profile.meta))
    if config.out is not None:
        plan.save(config.out, overwrite=config.force)
    print(plan.table())
    print()
    print(plan.explain())
    print(f"wrote {config.out}" if config.out is not None else
          "not saved: pass --out plans/NAME.json to keep this plan")
    return 0


@_register
def _simulate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _command(sub, "simulate", SimulateConfig, _simulate, "predict a plan's pipeline timeline")


def _simulate(args: argparse.Namespace) -> int:
    from autopipe.core.plan import Plan
    from autopipe.core.profile_table import Profile
    from autopipe.core.simulator import simulate

    config: SimulateConfig = from_namespace(SimulateConfig, args)
    profile = None if config.profile is None else Profile.load(config.profile)
    print(simulate(Plan.load(config.plan), profile, schedule=config.schedule).summary())
    return 0


@_register
def _plot_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _command(sub, "plot", PlotConfig, _plot,
             "draw a plan's balance, layers or timeline to an image file")


def _plot(args: argparse.Namespace) -> int:
    from autopipe.plot import plot_plan_file

    config: PlotConfig = from_namespace(PlotConfig, args)
    out = plot_plan_file(config.plan, config.out, profile=config.profile, figure=config.figure,
                         schedule=config.schedule, force=config.force)
    print(f"wrote {out}")
    return 0


@_register
def _train_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _command(sub, "train", TrainConfig, _train,
             "profile, partition and train a model as a GPipe pipeline in this process")


def _train(args: argparse.Namespace) -> int:
    from autopipe.app.train import train_example

    config: TrainConfig = from_namespace(TrainConfig, args)
    train_example(config.model, stages=config.stages, chunks=config.chunks,
                  batch_size=config.batch_size, steps=config.steps, recompute=config.recompute,
                  devices=config.devices, method=config.method, plan=config.plan,
                  profile=config.profile, lr=config.lr, clip_grad=config.clip_grad,
                  host_allocator=config.host_allocator, precision=config.precision,
                  checkpoint_dir=config.checkpoint_dir, checkpoint_every=config.checkpoint_every,
                  resume=config.resume, keep=config.keep)
    return 0


@_register
def _run_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _command(sub, "run", RunConfig, _run,
             "train a model as a multi-process pipeline, one stage per process (torchrun)")


def _run(args: argparse.Namespace) -> int:
    from autopipe.app.launch import run

    return run(from_namespace(RunConfig, args))


@_register
def _comm_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _command(sub, "comm", CommConfig, _comm,
             "time the link between two ranks (on this host, or one on each of two with --nnodes 2) "
             "into FILE.json for `profile --comm-from`")


def _comm(args: argparse.Namespace) -> int:
    from autopipe.app.comm_job import measure_link

    return measure_link(from_namespace(CommConfig, args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
