import os
from pathlib import Path

# One tokenizer/corpus cache for the whole suite (and the worker processes it spawns).
os.environ.setdefault("MESHFOLD_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "meshfold"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
