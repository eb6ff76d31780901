"""Context parallel (ring, Ulysses, hybrid; per-sequence): ``plan.py`` is the entry point and
the whole picture."""
