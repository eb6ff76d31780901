"""Tensor (and sequence) parallel: ``plan.py`` is the entry point and the layout table."""
