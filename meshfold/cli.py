"""``meshfold`` command line. Each subcommand lives in its own module with
``add_parser(subparsers)`` and ``run(args) -> int``; add new ones to ``SUBCOMMANDS``.

Only the subcommand that runs is imported: ``meshfold --help`` lists the others from the
table's one-line helps, and a subcommand whose module loads torch at import time declares
its arguments in a light module (``Subcommand.arguments``), so its ``--help`` is fast too."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

from meshfold.cli_arguments import CONVERT_HELP
from meshfold.errors import ConfigError, did_you_mean
from meshfold.schedules import get_schedule, schedule_names  # stdlib only: no start-up cost
from meshfold.schedules.simulate import simulate


class Subcommand(NamedTuple):
    module: str  # provides run(args) and add_parser(subparsers) (or dicts of them by name)
    help: str  # its line in `meshfold --help` (tests/test_cli_help.py: the same as add_parser's)
    arguments: str = ""  # provides add_parser instead, where ``module`` imports torch (seconds)


SUBCOMMANDS = {
    "train": Subcommand("meshfold.cli", "train a model from a TOML config"),
    "plot": Subcommand("meshfold.cli", "write PNG curves of a run's metrics"),
    "timeline": Subcommand("meshfold.cli", "draw a pipeline schedule as a PNG (a run's measured step, or a schedule)"),
    "calibrate-cost": Subcommand("meshfold.cli", "measure the document cost model W(l) = a l^2 + b l"),
    "prepare": Subcommand("meshfold.data.prepare", "tokenise corpora once into a sharded, memory-mapped dataset"),
    "convert": Subcommand("meshfold.convert", CONVERT_HELP, arguments="meshfold.cli_arguments"),
    "plan": Subcommand("meshfold.planner.cli", "search parallel layouts for a model and batch on a cluster"),
    "simulate": Subcommand("meshfold.planner.cli", "predict one layout (the config's [parallel]) in detail"),
    "calibrate": Subcommand("meshfold.calibration", "measure compute and alpha/beta with gloo processes; write a "
                                                    "cluster file", arguments="meshfold.cli_arguments"),
    "netlab": Subcommand("meshfold.netlab_cli", "run over throttled links in network namespaces (root)"),
    "dry-run": Subcommand("meshfold.dryrun", "build and step a layout for N ranks on this machine (fake ranks, "
                                             "fake tensors): memory per rank and collectives, next to the planner's",
                          arguments="meshfold.cli_arguments"),
    "btm": Subcommand("meshfold.btm", "Branch-Train-Merge: branch a seed per domain, merge or ensemble the branches",
                      arguments="meshfold.cli_arguments"),
}


def _fail(message: str) -> int:
    line = f"meshfold: error: {message}"
    if os.environ.get("RANK", "0") == "0":  # under a launcher every rank finds the same error: say it once
        print(line, file=sys.stderr)
    tell_launcher(line)
    return 2


def tell_launcher(line: str) -> None:
    """Under torchrun (or ``--nproc``), leave this worker's one line in the error file its
    agent reads: torchrun's failure report then names it as the root cause instead of "To
    enable traceback see ..." (the report itself, and the exit code, are torchrun's)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,  # torchelastic's format
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # the line is on stderr already


# --------------------------------------------------------------------------- train


# Launch policies: a feature that changes how a run's processes start names its module here
# (it exports ``POLICY``, with the methods of ``PlainLaunch``); the first that applies is used.
LAUNCH_POLICIES = ("meshfold.live_launch",)


class PlainLaunch:
    """How a run's processes start when no registered policy applies."""

    @staticmethod
    def applies(cfg) -> bool:
        return True

    @staticmethod
    def worker_config(cfg):
        """The config this process runs (a policy may give it a part of the job's layout)."""
        return cfg

    @staticmethod
    def launch(nproc: int, argv: list[str], cfg, max_restarts: int) -> int | None:
        """``--nproc N`` outside torchrun: the exit code of the policy's own launch, or None
        for the plain one (``launch.launch_local``)."""
        return None

    @staticmethod
    def refusal(cfg, world: int) -> str | None:
        """Under a launcher that is not the policy's: why the run cannot go on, or None."""
        return None


def launch_policy(cfg):
    for name in LAUNCH_POLICIES:
        policy = importlib.import_module(name).POLICY
        if policy.applies(cfg):
            return policy
    return PlainLaunch


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model from a TOML config")
    p.add_argument("config", help="TOML config, e.g. configs/debug.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--nproc", type=int, default=None, help="start N local processes (torchrun's launcher)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restart all workers this many times after a failure (with "
                        "train.live_recovery: each replica group's own, default 3)")
    p.add_argument("--force", action="store_true",
                   help="start even where the planner's memory estimate says the layout does not fit")


def run_train(args) -> int:
    from meshfold.config import load_config, validate
    from meshfold.launch import (EXIT_STOPPED, CheckpointError, RunDirError, Stopped, StopRequest, die_with_parent,
                                 describe_os_error, env_world_size, init_distributed, launch_local,
                                 shutdown_distributed, under_torchrun)

    cfg = load_config(args.config, args.set)
    checked = FIT_CHECKED in os.environ  # a worker of --nproc: its launcher said it all
    if cfg.model_note and not checked and os.environ.get("RANK", "0") == "0":
        print(f"meshfold: {cfg.model_note}", flush=True)
    policy = launch_policy(cfg)  # e.g. live recovery: one replica group's inner layout
    cfg = policy.worker_config(cfg)
    if args.nproc is not None and not under_torchrun():
        if args.nproc < 1:
            return _fail(f"--nproc must be >= 1, got {args.nproc}")
        if args.max_restarts < 0:
            return _fail(f"--max-restarts must be >= 0, got {args.max_restarts}")
        validate(cfg, args.nproc)  # one line now, before any process starts
        if not fits_memory(cfg, args.nproc, args.nproc, args):
            return 2
        checked = True
        argv = ["train", args.config] + [x for s in args.set for x in ("--set", s)]
        os.environ[FIT_CHECKED] = "1"  # the workers inherit it: checked once, here
        try:
            code = policy.launch(args.nproc, argv, cfg, args.max_restarts)  # e.g. one agent per replica group
            if code is None and (args.nproc > 1 or args.max_restarts):
                code = launch_local(args.nproc, argv, args.max_restarts)
        except RunDirError as err:  # a busy or unusable run directory: one line
            return _fail(str(err))
        finally:
            os.environ.pop(FIT_CHECKED, None)
        if code is not None:
            return code
    refusal = policy.refusal(cfg, env_world_size())
    if refusal is not None:
        return _fail(refusal)
    world = env_world_size()
    validate(cfg, world)
    if not checked:
        # Under a launcher of its own (torchrun), ranks cannot agree on a refusal before
        # they meet: rank 0 says the estimate and the run goes on.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if not fits_memory(cfg, world, local, args, refuse=not under_torchrun(),
                           quiet=int(os.environ.get("RANK", "0")) != 0):
            return 2
    die_with_parent()  # a worker of a launcher (--nproc, torchrun) never outlives it
    rank = int(os.environ.get("RANK", "0"))
    stop = StopRequest(rank).install()  # SIGTERM / SIGINT / SIGUSR1: finish the step, checkpoint, stop
    clean = False
    try:
        init_distributed(cfg.train.collective_timeout_s)
        from meshfold.train.trainer import Trainer

        trainer = Trainer(cfg)
        trainer.stop = stop
        trainer.fit()
        if rank == 0:
            print(f"meshfold: done: {trainer.step} steps, final loss {trainer.losses[-1]:.4f}; "
                  f"run directory {cfg.train.run_dir}" if trainer.losses else "meshfold: nothing to do")
        clean = True
        return 0
    except Stopped as err:
        clean = True  # every rank stopped after the same step
        if err.failure is not None:
            print(f"meshfold: rank {rank}: stopped by {err.signame} after step {err.step}, but {err.failure}",
                  file=sys.stderr)
            return 1
        if rank == 0 and err.saved is not None:  # None: a live replica whose peer writes the checkpoint
            print(f"meshfold: stopped by {err.signame} after step {err.step}; checkpoint {err.saved}; run the same "
                  f"command again to resume (exit code {EXIT_STOPPED})", file=sys.stderr)
        return EXIT_STOPPED
    except ConfigError as err:
        if rank == 0:  # every rank hits the same configuration error: say it once
            print(f"meshfold: error: {err}", file=sys.stderr)
        tell_launcher(f"meshfold: error: {err}")  # torchrun's report names it as the root cause
        return 2
    except (RunDirError, CheckpointError) as err:  # one line: the path and the cause
        if rank == 0 or "rank 0 refused" not in str(err):
            print(f"meshfold: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"meshfold: rank {rank}: error: {describe_os_error(err)}", file=sys.stderr)
        return 1
    except Exception as err:  # one line per failing rank; the traceback goes to a file
        log = _error_log(Path(cfg.train.run_dir), rank)
        where = f"traceback in {log}" if log is not None else "no traceback file: the run directory is unwritable"
        print(f"meshfold: rank {rank}: {type(err).__name__}: {err} ({where})", file=sys.stderr)
        tell_launcher(f"meshfold: rank {rank}: {type(err).__name__}: {err} ({where})")
        return 1
    finally:
        stop.uninstall()
        shutdown_distributed(clean)


# Set for the workers of ``--nproc``: their launcher checked the memory estimate.
FIT_CHECKED = "MESHFOLD_FIT_CHECKED"


def fits_memory(cfg, world: int, local: int, args, refuse: bool = True, quiet: bool = False) -> bool:
    """The planner's peak for this layout here, said before the build (``building ...``);
    False (after one line) where it cannot fit and neither ``--force`` nor a foreign
    launcher says go on."""
    from meshfold.planner.fit import check_fit

    try:
        fit = check_fit(cfg, world, local, args.config)
    except (ConfigError, ValueError, KeyError, NotImplementedError) as err:  # a layout the planner cannot price
        if not quiet:
            print(f"meshfold: no memory estimate for this layout ({err}); starting without one", flush=True)
        return True
    if fit.fits or args.force or not refuse:
        if not quiet:
            print(f"meshfold: {fit.building_line()}", flush=True)
            if not fit.fits:
                print(f"meshfold: warning: this may not fit: {fit.refusal()}", file=sys.stderr, flush=True)
        return True
    _fail(fit.refusal())
    return False


def _error_log(run_dir: Path, rank: int) -> Path | None:
    """Write the traceback next to the run if the run directory takes it, else into the
    temporary folder; the handler must not fail again where the run failed."""
    import tempfile

    text = traceback.format_exc()
    for folder in (run_dir, Path(tempfile.gettempdir())):
        if not folder.is_dir():
            continue
        log = folder / (f"error-rank{rank}.log" if folder == run_dir else f"meshfold-error-rank{rank}-{os.getpid()}.log")
        try:
            log.write_text(text)
            return log
        except OSError:
            continue
    return None


# --------------------------------------------------------------------------- plot


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="write PNG curves of a run's metrics")
    p.add_argument("run_dir", help="a run directory (its metrics.jsonl)")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")


def run_plot(args) -> int:
    from meshfold.train.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


# --------------------------------------------------------------------------- calibrate-cost


def add_calibrate_cost_parser(sub) -> None:
    p = sub.add_parser("calibrate-cost", help="measure the document cost model W(l) = a l^2 + b l")
    p.add_argument("config", help="TOML config (its [model] and train.dtype/device are measured)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--lengths", default="", help="comma-separated document lengths (default: up to seq_len)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per length; the fastest counts (default 3)")
    p.add_argument("--json", action="store_true", help="print the fit as one JSON object")


def run_calibrate_cost(args) -> int:
    from meshfold.config import load_config, validate
    from meshfold.data import cost_calibration
    from meshfold.device import resolve_device, resolve_dtypes

    cfg = validate(load_config(args.config, args.set))
    device = resolve_device(cfg.train.device)
    dtype, autocast_dtype = resolve_dtypes(cfg.train.dtype, device)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()] or None
    fit = cost_calibration.measure_cost(cfg.model, device, dtype, lengths, args.repeats, autocast_dtype=autocast_dtype)
    if args.json:
        print(json.dumps({"a": fit.a, "b": fit.b, "c": fit.c, "lengths": fit.lengths, "counts": fit.counts,
                          "seconds": fit.seconds, "max_rel_error": fit.rel_error()}))
        return 0
    print(f"{'doc tokens':>10} {'docs':>5} {'measured s':>12} {'fit s':>12}")
    for l, k, s in zip(fit.lengths, fit.counts, fit.seconds):
        print(f"{l:>10} {k:>5} {s:>12.6f} {k * (fit.a * l * l + fit.b * l) + fit.c:>12.6f}")
    half = (fit.b / fit.a) if fit.a > 0 else float("inf")
    print(f"W(l) = {fit.a:.4e} * l^2 + {fit.b:.4e} * l   (per-micro-batch overhead {fit.c:.4e} s; "
          f"attention dominates beyond l = {half:.0f} tokens)")
    print(f"--set data.cost_a={fit.a:.6e} --set data.cost_b={fit.b:.6e}")
    return 0


# --------------------------------------------------------------------------- timeline


def add_timeline_parser(sub) -> None:
    p = sub.add_parser("timeline", help="draw a pipeline schedule as a PNG (a run's measured step, or a schedule)")
    p.add_argument("run_dir", nargs="?", help="run directory of a pipeline-parallel training run")
    p.add_argument("--step", type=int, default=0, help="which logged step (default: the last)")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/plots/timeline-step-N.png)")
    p.add_argument("--schedule", choices=schedule_names(),
                   help="draw a schedule's unit-cost simulation instead of a run")
    p.add_argument("--pp", type=int, default=4, help="with --schedule: pipeline stages (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="with --schedule: micro-batches per step (default 8)")
    p.add_argument("--virtual", type=int, default=2, help="chunks per rank for interleaved")


def run_timeline(args) -> int:
    from meshfold.parallel.pp.timeline_plot import TIMELINE_FILE, draw_timeline

    if args.schedule:
        schedule = get_schedule(args.schedule)
        problem = schedule.microbatch_problem(args.pp, args.microbatches)
        if problem:
            raise ConfigError(f"meshfold timeline --microbatches: {problem}")
        virtual = schedule.virtual_of(args.virtual)
        events = simulate(schedule, schedule.actions(args.pp, virtual, args.microbatches))
        out = args.out or f"timeline-{args.schedule}-pp{args.pp}-m{args.microbatches}.png"
        title = f"{args.schedule}, pp {args.pp}, {args.microbatches} micro-batches (simulated, unit costs)"
        print(draw_timeline(events, out, title))
        return 0
    if not args.run_dir:
        raise ConfigError("meshfold timeline: give RUN_DIR or --schedule")
    path = Path(args.run_dir) / TIMELINE_FILE
    if not path.exists():
        raise ConfigError(f"{path} does not exist; train with parallel.pp > 1 to log pipeline timings")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    chosen = [r for r in records if r["step"] == args.step] if args.step else records[-1:]
    if not chosen:
        raise ConfigError(f"step {args.step} is not in {path}; logged steps: {records[0]['step']}..{records[-1]['step']}")
    rec = chosen[-1]
    out = args.out or Path(args.run_dir) / "plots" / f"timeline-step-{rec['step']}.png"
    title = (f"{rec['schedule']}, pp {rec['pp']}, {rec['microbatches']} micro-batches, "
             f"step {rec['step']} (measured)")
    print(draw_timeline(rec["events"], out, title))
    return 0


add_parser = {"train": add_train_parser, "plot": add_plot_parser, "calibrate-cost": add_calibrate_cost_parser,
              "timeline": add_timeline_parser}
run = {"train": run_train, "plot": run_plot, "calibrate-cost": run_calibrate_cost, "timeline": run_timeline}


# --------------------------------------------------------------------------- entry


def _by_name(table, name: str):
    return table[name] if isinstance(table, dict) else table


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser (every subcommand's arguments), or (``only``) one subcommand's in
    full and the others as their help line: a command then imports only its own module,
    not every feature's (start-up time on a loaded machine)."""
    parser = argparse.ArgumentParser(
        prog="meshfold", description="Train transformer LMs folded onto a device mesh; plan and simulate layouts.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=command.help)
            continue
        module = importlib.import_module(command.arguments or command.module)
        _by_name(module.add_parser, name)(sub)
    return parser


def _chosen_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The innermost subcommand's parser ``args`` went through (e.g. ``netlab train``'s)."""
    while True:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None or getattr(args, action.dest, None) not in action.choices:
            return parser
        parser = action.choices[getattr(args, action.dest)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = argv[0] if argv else ""
    parser = build_parser(first if first in SUBCOMMANDS else "")
    if first and not first.startswith("-") and first not in SUBCOMMANDS:
        parser.error(f"unknown command {first!r}{did_you_mean(first, SUBCOMMANDS)}; choose one of "
                     f"{', '.join(SUBCOMMANDS)}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said with the subcommand's usage, not the top-level one
        _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    module = importlib.import_module(SUBCOMMANDS[args.command].module)
    runner = _by_name(module.run, args.command)
    try:
        return runner(args)
    except ConfigError as err:
        return _fail(str(err))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
