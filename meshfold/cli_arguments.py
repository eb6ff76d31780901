"""The arguments of the subcommands whose modules import torch when they load
(``meshfold.calibration``, ``meshfold.dryrun``): declared here, with the standard library
only, so ``meshfold calibrate --help`` and ``meshfold dry-run --help`` answer without
loading torch (``cli.py``'s ``Subcommand.arguments`` names this module)."""

from __future__ import annotations


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure compute and alpha/beta with gloo processes; write a cluster file")
    p.add_argument("--nproc", type=int, default=4,
                   help="gloo processes to measure with, all busy at once, as a training run's would be (default 4)")
    p.add_argument("--out", default=None,
                   help="cluster TOML to write (default cluster-cpu-N.toml, with --gpu cluster-gpu.toml)")
    p.add_argument("--gpu", default=None, metavar="PRESET",
                   help="measure this machine's GPU instead (GEMM, HBM copy, fused attention) and write "
                        "PRESET's cluster with the measured efficiencies (e.g. --gpu h100)")


def add_dry_run_parser(sub) -> None:
    p = sub.add_parser("dry-run", help="build and step a layout for N ranks on this machine (fake ranks, "
                                       "fake tensors): memory per rank and collectives, next to the planner's")
    p.add_argument("config", help="TOML config, e.g. configs/debug.toml")
    p.add_argument("--world", type=int, required=True, help="number of ranks (GPUs) to simulate")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--cluster", default="h100", help="planner cluster preset or TOML (default h100)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: fake CUDA tensors; adds host syncs, attention kernels, wire dtypes and errors "
                        "(docs/gpu.md); exit 1 when there are errors")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")


add_parser = {"calibrate": add_calibrate_parser, "dry-run": add_dry_run_parser}
