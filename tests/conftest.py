import os
from pathlib import Path

# One tokenizer/corpus cache for the whole suite (and the worker processes it spawns).
os.environ.setdefault("MESHFOLD_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "meshfold"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# MFU's CPU peak: without it every process that builds a Trainer probes matmul speed for
# 0.8 s (several rank processes at once on 2 cores); tests/test_cli.py tests the probe itself.
os.environ.setdefault("MESHFOLD_PEAK_TFLOPS", "1")
# Strict mode (meshfold/comm.py, docs/communication.md): gloo made to fail where NCCL would
# (host tensors at collectives, tagged p2p). The pool workers inherit it; MESHFOLD_STRICT=0 turns it off.
os.environ.setdefault("MESHFOLD_STRICT", "1")
