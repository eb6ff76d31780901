"""``meshfold`` command line. Each subcommand lives in its own module with
``add_parser(subparsers)`` and ``run(args) -> int``; add new ones to ``SUBCOMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from pathlib import Path

from meshfold.config import ConfigError

# name -> module providing add_parser(subparsers) and run(args)
SUBCOMMANDS = {
    "train": "meshfold.cli",
    "plot": "meshfold.cli",
    "timeline": "meshfold.parallel.timeline",
    "calibrate-cost": "meshfold.data.cost_calibration",
    "prepare": "meshfold.data.prepare",
    "convert": "meshfold.models.hf",
    "plan": "meshfold.planner.cli", "simulate": "meshfold.planner.cli", "calibrate": "meshfold.calibration",
    "netlab": "meshfold.lowcomm.cli",
    "dry-run": "meshfold.dryrun",
}


def _fail(message: str) -> int:
    print(f"meshfold: error: {message}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------- train


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model from a TOML config")
    p.add_argument("config", help="TOML config, e.g. configs/debug.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--nproc", type=int, default=0, help="start N local processes (torchrun's launcher)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restart all workers this many times after a failure")


def run_train(args) -> int:
    from meshfold.config import load_config, validate
    from meshfold.launch import env_world_size, init_distributed, launch_local, shutdown_distributed, under_torchrun

    cfg = load_config(args.config, args.set)
    if args.nproc and not under_torchrun():
        if args.nproc < 1:
            return _fail(f"--nproc must be >= 1, got {args.nproc}")
        validate(cfg, args.nproc)  # one line now, before any process starts
        if args.nproc > 1 or args.max_restarts:
            argv = ["train", args.config] + [x for s in args.set for x in ("--set", s)]
            return launch_local(args.nproc, argv, args.max_restarts)
    world = env_world_size()
    validate(cfg, world)
    init_distributed(cfg.train.collective_timeout_s)
    rank = int(os.environ.get("RANK", "0"))
    clean = False
    try:
        from meshfold.train.trainer import Trainer

        trainer = Trainer(cfg)
        trainer.fit()
        if rank == 0:
            print(f"meshfold: done: {trainer.step} steps, final loss {trainer.losses[-1]:.4f}; "
                  f"run directory {cfg.train.run_dir}" if trainer.losses else "meshfold: nothing to do")
        clean = True
        return 0
    except ConfigError as err:
        if rank == 0:  # every rank hits the same configuration error: say it once
            print(f"meshfold: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # one line per failing rank; the traceback goes to a file
        log = Path(cfg.train.run_dir) / f"error-rank{rank}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
        print(f"meshfold: rank {rank}: {type(err).__name__}: {err} (traceback in {log})", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed(clean)


# --------------------------------------------------------------------------- plot


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="write PNG curves of a run's metrics")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")


def run_plot(args) -> int:
    from meshfold.train.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


add_parser = {"train": add_train_parser, "plot": add_plot_parser}
run = {"train": run_train, "plot": run_plot}


# --------------------------------------------------------------------------- entry


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or (``only``) just one subcommand's: a command then imports only
    its own module, not every feature's (start-up time on a loaded machine)."""
    parser = argparse.ArgumentParser(
        prog="meshfold", description="Train transformer LMs folded onto a device mesh; plan and simulate layouts.")
    sub = parser.add_subparsers(dest="command", required=True)
    names = [only] if only in SUBCOMMANDS else list(SUBCOMMANDS)
    for name in names:
        module = importlib.import_module(SUBCOMMANDS[name])
        adder = module.add_parser[name] if isinstance(module.add_parser, dict) else module.add_parser
        adder(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command])
    runner = module.run[args.command] if isinstance(module.run, dict) else module.run
    try:
        return runner(args)
    except ConfigError as err:
        return _fail(str(err))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
