"""The ``autopipe`` command line: argv -> config -> one library call. No logic lives here.

    autopipe profile MODEL ...       measure a model's layers            (autopipe.profiler)
    autopipe partition PROFILE ...   balance the layers into stages      (autopipe.partition)
    autopipe simulate PLAN ...       predict the pipeline's timeline     (autopipe.simulate)
    autopipe plot PLAN ...           draw balance / timeline figures     (autopipe.plot)
    autopipe run MODEL --plan ...    train a bundled example with torchrun (executor.distributed)

Every AutopipeError (a ValueError subclass with a one-line message saying what to do) is printed
as ``autopipe: error: ...`` and the exit status is 2; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from autopipe.errors import AutopipeError

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
    except AutopipeError as err:
        print(f"autopipe: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"autopipe: error: {err.filename or err}: no such file", file=sys.stderr)
        return 2


# --- subcommands -------------------------------------------------------------------------------
# Add each subcommand below as a ``@_register``-decorated function that adds a subparser with
# ``set_defaults(func=handler)``; the handler parses nothing itself and calls one library function.


@_register
def _profile_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("profile", help="measure a model's layers into profiles/NAME.csv")
    p.add_argument("model", metavar="MODEL",
                   help="bundled example (mlp, cnn, gpt, unet) or package.module:factory")
    p.add_argument("--batch-size", type=int, default=None, help="mini-batch size B (default 32)")
    p.add_argument("--chunks", type=int, default=1, help="micro-batches per batch M; one "
                   "micro-batch of ceil(B/M) rows is profiled (default 1)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    p.add_argument("--out", default=None, help="profiles/NAME.csv (default: from MODEL)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per layer (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 2)")
    p.add_argument("--max-depth", type=int, default=None, help="keep submodules at this depth whole")
    p.add_argument("--leaf", action="append", default=None, metavar="NAME",
                   help="submodule name or class to keep whole as one layer (repeatable)")
    p.add_argument("--input-shape", default=None, help="one sample's shape, e.g. 3,32,32, "
                   "when the factory returns a model without inputs")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads while measuring")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from autopipe.profile_report import profile_to_file, summary_table

    prof, path = profile_to_file(
        args.model, out=args.out, force=args.force, batch_size=args.batch_size,
        chunks=args.chunks, device=args.device, repeats=args.repeats, warmup=args.warmup,
        max_depth=args.max_depth, leaf=args.leaf, input_shape=args.input_shape,
        threads=args.threads,
    )
    print(summary_table(prof))
    print(f"wrote {path} and {path.with_suffix('.json')}")
    return 0


@_register
def _partition_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("partition", help="balance a profile's layers into pipeline stages")
    p.add_argument("profile", help="profiles/NAME.csv (with NAME.json beside it)")
    p.add_argument("--stages", type=int, required=True, help="number of pipeline stages K")
    p.add_argument("--method", default="auto", help="auto | dp | ilp | uniform | params | blockpartition")
    p.add_argument("--memory", default=None, help="per-device memory limit, e.g. 16GiB")
    p.add_argument("--chunks", type=int, default=None,
                   help="micro-batches per batch M (default: the profile's, else 8)")
    p.add_argument("--checkpoint", default="except_last", help="always | except_last | never")
    p.add_argument("--optimizer", default="adam", help="none | sgd | momentum | adam | adamw")
    p.add_argument("--ties", default="share", help="share | colocate (tied parameters)")
    p.add_argument("--bandwidth", type=float, default=10e9, help="bytes/s between stages (0 = free)")
    p.add_argument("--time-limit", type=float, default=60, help="ILP time limit in seconds")
    p.add_argument("--out", required=True, help="plans/NAME.json")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(func=_partition)


def _partition(args: argparse.Namespace) -> int:
    from autopipe.errors import PlanError
    from autopipe.partition import partition
    from autopipe.profile import Profile

    if os.path.exists(args.out) and not args.force:  # fail before solving, not after
        raise PlanError(f"{args.out} already exists: refusing to overwrite a saved plan; pass --force")
    plan = partition(Profile.load(args.profile), stages=args.stages, method=args.method,
                     chunks=args.chunks, checkpoint=args.checkpoint, memory_limit=args.memory,
                     optimizer=args.optimizer, time_limit=args.time_limit, ties=args.ties,
                     bandwidth=args.bandwidth or None)
    plan.save(args.out, overwrite=args.force)
    print(plan.table())
    print()
    print(plan.explain())
    print(f"wrote {args.out}")
    return 0


@_register
def _simulate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("simulate", help="predict a plan's pipeline timeline")
    p.add_argument("plan", help="plans/NAME.json")
    p.add_argument("--profile", default=None, help="profiles/NAME.csv to recompute stage costs from")
    p.add_argument("--schedule", default="gpipe", help="gpipe | 1f1b")
    p.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from autopipe.plan import Plan
    from autopipe.profile import Profile
    from autopipe.simulate import simulate

    profile = None if args.profile is None else Profile.load(args.profile)
    print(simulate(Plan.load(args.plan), profile, schedule=args.schedule).summary())
    return 0


@_register
def _plot_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plot", help="draw a plan's balance, layers or timeline to an image file")
    p.add_argument("plan", help="plans/NAME.json")
    p.add_argument("--profile", default=None, help="profiles/NAME.csv: check the plan against it "
                   "and recompute stage costs from it (needed by --layers)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--timeline", action="store_const", const="timeline", dest="figure",
                      help="the simulated pipeline timeline instead of the balance bars")
    what.add_argument("--layers", action="store_const", const="layers", dest="figure",
                      help="per-layer time and memory with the plan's cuts (needs --profile)")
    p.add_argument("--schedule", default="gpipe", help="gpipe | 1f1b (with --timeline)")
    p.add_argument("--out", required=True, help="image file: .png, .svg or .pdf")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(func=_plot, figure="balance")


def _plot(args: argparse.Namespace) -> int:
    from autopipe.plot import plot_plan_file

    out = plot_plan_file(args.plan, args.out, profile=args.profile, figure=args.figure,
                         schedule=args.schedule, force=args.force)
    print(f"wrote {out}")
    return 0


@_register
def _train_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train", help="profile, partition and train a bundled example as a GPipe pipeline"
    )
    p.add_argument("example", help="bundled example: mlp | cnn | gpt | unet")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages K (default 2)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per batch M (default 4)")
    p.add_argument("--batch-size", type=int, default=32, help="mini-batch size (default 32)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--checkpoint", default="except_last", help="always | except_last | never")
    p.add_argument("--devices", nargs="+", default=None, help="one per stage (default: cpu)")
    p.add_argument("--method", default="auto", help="partition method (default auto)")
    p.add_argument("--plan", default=None, help="use this saved plan instead of partitioning")
    p.add_argument("--profile", default=None, help="use this saved profile instead of measuring")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from autopipe.train import train_example

    train_example(args.example, stages=args.stages, chunks=args.chunks,
                  batch_size=args.batch_size, steps=args.steps, checkpoint=args.checkpoint,
                  devices=args.devices, method=args.method, plan=args.plan,
                  profile=args.profile, lr=args.lr)
    return 0


@_register
def _run_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("run", help="train a bundled example as a multi-process pipeline (torchrun)")
    p.add_argument("model", help="bundled example: mlp | cnn | gpt | unet")
    p.add_argument("--plan", default=None, help="plans/NAME.json (default: rank 0 partitions)")
    p.add_argument("--nproc", type=int, default=2, help="processes = pipeline ranks (default 2)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--batch-size", type=int, default=32, help="mini-batch size (default 32)")
    p.add_argument("--chunks", type=int, default=None, help="micro-batches (default: the plan's, else 8)")
    p.add_argument("--schedule", default="gpipe", help="gpipe | 1f1b | interleaved1f1b")
    p.add_argument("--checkpoint", default=None, help="always | except_last | never (default: the plan's)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--timeout", type=float, default=60, help="seconds before a silent rank is an error")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from autopipe.launch import RunConfig, run

    return run(RunConfig(args.model, nproc=args.nproc, plan=args.plan, steps=args.steps,
                         batch_size=args.batch_size, chunks=args.chunks, schedule=args.schedule,
                         checkpoint=args.checkpoint, lr=args.lr, timeout=args.timeout))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
