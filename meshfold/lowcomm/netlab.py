"""A network lab: N network namespaces on a shaped star, for training over slow links.

Topology (all inside namespaces; nothing is added to the host's own network)::

    mf<id>n0 --veth-- \\
    mf<id>n1 --veth--  bridge in mf<id>hub
    ...      --veth-- /

Node i has one interface with address 10.<a>.<b>.(i+1)/24. Its link is shaped in both
directions with a token bucket filter (``tc qdisc ... tbf``): on the node's end (upload)
and on the hub's end (download), each at ``rate_mbit``. ``netem`` is not used. The lab is
removed on exit, on an exception and on SIGTERM/SIGINT (deleting a namespace deletes its
veth ends); ``cleanup_stale()`` removes leftovers of labs whose process died (SIGKILL).

Needs root (CAP_NET_ADMIN) and iproute2. ``meshfold netlab`` is the command line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

PREFIX = "mf"


class NetLabError(RuntimeError):
    pass


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise NetLabError(f"{' '.join(cmd)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def available() -> tuple[bool, str]:
    """(True, "") if namespaces, veth and tbf work here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root (CAP_NET_ADMIN) to create network namespaces"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return False, f"needs iproute2 ({tool} not found; apt-get install iproute2)"
    name = f"{PREFIX}probe{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        _run("tc", "-n", name, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "10mbit", "burst", "64kb",
             "latency", "100ms")
        _run("ip", "-n", name, "link", "add", "br0", "type", "bridge")
    except NetLabError as err:
        return False, f"network namespaces / veth / tbf / bridge unavailable: {err}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return True, ""


def lab_namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.strip().startswith(PREFIX)]


def cleanup_stale() -> list[str]:
    """Delete namespaces of labs whose owning process is gone. Returns the names removed."""
    import re

    removed = []
    for ns in lab_namespaces():
        m = re.match(rf"{PREFIX}(?:probe)?(\d+)", ns)
        if m and int(m.group(1)) != os.getpid() and _alive(int(m.group(1))):
            continue
        _run("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


_COUNT = [0]


def _next_tag() -> str:
    """<pid><letter>: unique per lab, and the owner's pid for ``cleanup_stale``."""
    _COUNT[0] += 1
    return f"{os.getpid()}{chr(96 + _COUNT[0] % 26 or 26)}"


@dataclass
class NetLab:
    """``with NetLab(nodes=4, rate_mbit=20) as lab: lab.popen(i, argv)``."""

    nodes: int
    rate_mbit: float
    burst_kb: int = 0  # 0 = max(64 KB, 10 ms at the rate)
    latency_ms: int = 400  # tbf queue: packets waiting longer are dropped
    subnet: str = "10.77.0"  # /24 inside the lab; namespaces are isolated, so labs may reuse it
    # {(a, b): Mbit/s}: traffic between nodes a and b (both directions) shaped to this rate on
    # the sender's end (an htb class per slow peer), everything else at ``rate_mbit``
    slow_links: dict = field(default_factory=dict)
    tag: str = field(default_factory=lambda: _next_tag())
    namespaces: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self):
        if self.nodes < 1:
            raise NetLabError("netlab: --nodes must be >= 1")
        if self.rate_mbit <= 0:
            raise NetLabError("netlab: --rate-mbit must be > 0")
        self._old_handlers = {}

    # ------------------------------------------------------------------ names
    @property
    def hub(self) -> str:
        return f"{PREFIX}{self.tag}h"

    def ns(self, i: int) -> str:
        return f"{PREFIX}{self.tag}n{i}"

    def ifname(self, i: int) -> str:
        return f"eth{i}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "NetLab":
        self._trap_signals()
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _trap_signals(self) -> None:
        def handler(signum, _frame):
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # not the main thread
                self._old_handlers[sig] = signal.signal(sig, handler)

    def _shape(self, ns: str, dev: str, node: int | None = None) -> None:
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = self.burst_kb * 1024 or max(64 * 1024, int(rate_bytes * 0.01))
        peers = {b if a == node else a: r for (a, b), r in self.slow_links.items() if node in (a, b)}
        if not peers:
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                 "burst", str(burst), "latency", f"{self.latency_ms}ms")
            return
        # per-destination rates: htb, a default class at rate_mbit and one class per slow peer
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
        _run("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate",
             f"{self.rate_mbit}mbit", "burst", str(burst))
        for peer, rate in sorted(peers.items()):
            cls = f"1:{10 + peer}"
            _run("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate",
                 f"{rate}mbit", "burst", str(max(16 * 1024, int(rate * 1e6 / 8 * 0.01))))
            _run("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                 "match", "ip", "dst", f"{self.addr(peer)}/32", "flowid", cls)

    def create(self) -> None:
        _run("ip", "netns", "add", self.hub)
        self.namespaces.append(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns = self.ns(i)
            _run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            # Created inside the hub namespace, then one end moved: never in the host's namespace.
            _run("ip", "-n", self.hub, "link", "add", f"p{i}", "type", "veth", "peer", "name", self.ifname(i))
            _run("ip", "-n", self.hub, "link", "set", self.ifname(i), "netns", ns)
            _run("ip", "-n", self.hub, "link", "set", f"p{i}", "master", "br0")
            _run("ip", "-n", self.hub, "link", "set", f"p{i}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", self.ifname(i))
            _run("ip", "-n", ns, "link", "set", self.ifname(i), "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            self._shape(ns, self.ifname(i), i)  # upload of node i (and its slow links)
            self._shape(self.hub, f"p{i}")  # download of node i

    def destroy(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 10
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.time()))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in reversed(self.namespaces):
            _run("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)
        self._old_handlers.clear()

    # ------------------------------------------------------------------ running
    def exec_argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def popen(self, i: int, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        full_env = dict(os.environ if env is None else env)
        full_env["GLOO_SOCKET_IFNAME"] = self.ifname(i)  # gloo: use the shaped link, not lo
        # c10d's C++ warns on every connection that a lab address has no hostname (a
        # namespace resolves no names): noise every lab run; errors still print.
        full_env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        p = subprocess.Popen(self.exec_argv(i, argv), env=full_env, start_new_session=True, **kwargs)
        self.procs.append(p)
        return p

    def run(self, i: int, argv: list[str], timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_argv(i, argv), timeout=timeout, **kwargs)

    def torchrun_argv(self, i: int, nproc_per_node: int, module_args: list[str], port: int = 29400) -> list[str]:
        """torchrun with the c10d multi-node rendezvous hosted on node 0's lab address."""
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nodes}",
                f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",  # c10d assigns node ranks
                f"--rdzv-endpoint={self.addr(0)}:{port}", f"--rdzv-id=netlab{self.tag}",
                # node 0 hosts the store: hostname lookup inside a namespace would not say so
                f"--rdzv-conf=is_host={1 if i == 0 else 0}",
                f"--local-addr={self.addr(i)}", "--max-restarts=0", "-m", *module_args]


# --------------------------------------------------------------------------- probe

_PROBE_SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
c.sendall(b"done"); c.close()
print(n, flush=True)
"""

_PROBE_CLIENT = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=600)
total = int(sys.argv[3]); chunk = b"x" * (1 << 16); sent = 0
t0 = time.perf_counter()
while sent < total:
    k = min(len(chunk), total - sent); c.sendall(chunk[:k]); sent += k
c.shutdown(socket.SHUT_WR); c.recv(16)
print(time.perf_counter() - t0, flush=True)
"""


def probe(lab: NetLab, nbytes: int, src: int = 0, dst: int = 1, port: int = 29411) -> float:
    """Send ``nbytes`` over TCP from node ``src`` to node ``dst``; returns seconds taken
    (until the receiver acknowledged the end of the stream)."""
    server = lab.popen(dst, [sys.executable, "-c", _PROBE_SERVER, lab.addr(dst), str(port)],
                       stdout=subprocess.PIPE, text=True)
    if server.stdout.readline().strip() != "ready":
        raise NetLabError("probe: receiver did not start")
    out = lab.run(src, [sys.executable, "-c", _PROBE_CLIENT, lab.addr(dst), str(port), str(nbytes)],
                  capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise NetLabError(f"probe: sender failed: {out.stderr.strip()}")
    received = int(server.stdout.readline().strip() or 0)
    server.wait(timeout=30)
    if received != nbytes:
        raise NetLabError(f"probe: {received} of {nbytes} bytes arrived")
    return float(out.stdout.strip())
