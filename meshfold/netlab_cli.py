"""``meshfold netlab``: train (or probe a link) inside a lab of throttled namespaces.

    meshfold netlab probe --rate-mbit 20 --mbytes 4
    meshfold netlab train CONFIG.toml --nodes 4 --nproc-per-node 1 --rate-mbit 20 [--set k=v ...]
    meshfold netlab cleanup

``train`` starts one torchrun per namespace (c10d multi-node rendezvous on node 0's lab
address), so every byte between nodes crosses a tbf-shaped veth link. The lab is always
removed afterwards, also when a node fails or the command is interrupted.
"""

from __future__ import annotations

import sys
import time

from meshfold.config import load_config, validate
from meshfold.lowcomm.netlab import NetLab, NetLabError, available, cleanup_stale, probe


def add_parser(sub) -> None:
    p = sub.add_parser("netlab", help="run over throttled links in network namespaces (root)")
    cmd = p.add_subparsers(dest="netlab_command", required=True)
    probe = cmd.add_parser("probe", help="time a TCP transfer between two lab nodes")
    probe.add_argument("--rate-mbit", type=float, default=20.0, help="link rate in Mbit/s (default 20)")
    probe.add_argument("--mbytes", type=float, default=4.0, help="megabytes to send (default 4)")
    train = cmd.add_parser("train", help="meshfold train, one torchrun per namespace")
    train.add_argument("config", help="TOML config, e.g. configs/debug.toml")
    train.add_argument("--nodes", type=int, default=2, help="lab nodes (network namespaces), one torchrun each (default 2)")
    train.add_argument("--nproc-per-node", type=int, default=1, help="processes per node (default 1)")
    train.add_argument("--rate-mbit", type=float, default=20.0,
                       help="rate of every link between nodes in Mbit/s, tbf-shaped (default 20)")
    train.add_argument("--slow-link", action="append", default=[], metavar="A,B,MBIT",
                       help="shape traffic between nodes A and B to MBIT Mbit/s (repeatable)")
    train.add_argument("--timeout", type=float, default=0.0, help="seconds before the run is stopped (0 = none)")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a config key (repeatable)")
    cmd.add_parser("cleanup", help="remove namespaces left by labs whose process died")


def _fail(msg: str) -> int:
    print(f"meshfold: error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:

    if args.netlab_command == "cleanup":
        for ns in cleanup_stale():
            print(f"removed {ns}")
        return 0
    ok, why = available()
    if not ok:
        return _fail(f"netlab: {why}")
    try:
        if args.netlab_command == "probe":
            nbytes = int(args.mbytes * 1e6)
            with NetLab(nodes=2, rate_mbit=args.rate_mbit) as lab:
                seconds = probe(lab, nbytes)
            print(f"netlab: {nbytes} bytes in {seconds:.2f} s = {nbytes * 8 / seconds / 1e6:.1f} Mbit/s "
                  f"(link shaped to {args.rate_mbit} Mbit/s)")
            return 0
        return _train(args)
    except NetLabError as err:
        return _fail(str(err))


def _train(args) -> int:

    cfg = load_config(args.config, args.set)
    validate(cfg, args.nodes * args.nproc_per_node)  # one line now, before any namespace exists
    module_args = ["meshfold", "train", args.config] + [x for s in args.set for x in ("--set", s)]
    start = time.perf_counter()
    try:
        slow = {(int(a), int(b)): float(r) for a, b, r in (x.split(",") for x in args.slow_link)}
    except ValueError:
        return _fail("netlab: --slow-link takes A,B,MBIT, e.g. --slow-link 0,1,2")
    with NetLab(nodes=args.nodes, rate_mbit=args.rate_mbit, slow_links=slow) as lab:
        procs = [lab.popen(i, lab.torchrun_argv(i, args.nproc_per_node, module_args)) for i in range(args.nodes)]
        code = 0
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or (args.timeout and time.perf_counter() - start > args.timeout):
                code = 1
                break  # leaving the lab stops the others
            time.sleep(0.2)
        code = code or max(p.returncode or 0 for p in procs)
    wall = time.perf_counter() - start
    print(f"meshfold netlab: {args.nodes} nodes x {args.nproc_per_node} processes at {args.rate_mbit} Mbit/s: "
          f"{'done' if code == 0 else 'FAILED'} in {wall:.1f} s", file=sys.stderr)
    return code
