"""The network lab really shapes bandwidth, and always removes its namespaces.

Skipped only where the machine cannot create network namespaces (no root / no iproute2);
the reason is printed by pytest -ra."""

import os
import signal
import subprocess
import sys

import pytest

from meshfold.lowcomm.netlab import NetLab, available, cleanup_stale, lab_namespaces, probe

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"netlab unavailable here: {WHY}")


def _mine(lab_tag: str) -> list[str]:
    return [ns for ns in lab_namespaces() if lab_tag in ns]


def test_transfer_takes_at_least_the_shaped_time():
    rate_mbit, nbytes = 16.0, 2_000_000
    expected = nbytes * 8 / (rate_mbit * 1e6)  # 1.0 s at 16 Mbit/s
    with NetLab(nodes=2, rate_mbit=rate_mbit) as lab:
        tag = lab.tag
        assert len(_mine(tag)) == 3  # hub + 2 nodes
        seconds = probe(lab, nbytes)
    # tbf lets one burst (64 KB = 3% of the transfer) through at line rate, nothing more
    assert seconds >= 0.9 * expected, f"{nbytes} B in {seconds:.2f} s: faster than {rate_mbit} Mbit/s"
    assert seconds < 4 * expected, f"{nbytes} B in {seconds:.2f} s: far slower than the shaped rate"
    assert _mine(tag) == []


def test_namespaces_removed_when_the_body_fails():
    with pytest.raises(RuntimeError, match="inside the lab"):
        with NetLab(nodes=3, rate_mbit=10) as lab:
            tag = lab.tag
            proc = lab.popen(0, [sys.executable, "-c", "import time; time.sleep(60)"])
            assert len(_mine(tag)) == 4
            raise RuntimeError("something failed inside the lab")
    assert proc.poll() is not None  # the process inside was stopped too
    assert _mine(tag) == []


def test_cleanup_after_sigkill_of_the_owner():
    code = ("from meshfold.lowcomm.netlab import NetLab; import time\n"
            "lab = NetLab(nodes=2, rate_mbit=10).__enter__(); print(lab.tag, flush=True); time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    tag = owner.stdout.readline().strip()
    assert len(_mine(tag)) == 3
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    removed = cleanup_stale()
    assert set(removed) >= {f"mf{tag}h", f"mf{tag}n0", f"mf{tag}n1"}
    assert _mine(tag) == []


def test_cli_run_failing_inside_the_lab_cleans_up(tmp_path):
    """The real command: one torchrun per namespace; the config passes validation, then the
    training processes fail inside the lab (a corpus too small for one sequence)."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("hello world\n")
    before = set(lab_namespaces())
    out = subprocess.run([sys.executable, "-m", "meshfold", "netlab", "train", "configs/debug.toml", "--nodes", "2",
                          "--rate-mbit", "50", "--timeout", "240",
                          "--set", f"train.run_dir='{tmp_path / 'run'}'", "--set", f"data.source='{corpus}'",
                          "--set", "data.val_docs=0"],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode != 0, out.stderr[-2000:]
    assert "FAILED" in out.stderr
    assert "too small for one sequence" in out.stderr, out.stderr[-2000:]  # raised inside the lab's ranks
    assert set(lab_namespaces()) - before == set()
