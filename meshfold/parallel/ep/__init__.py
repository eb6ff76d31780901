"""Expert parallel, folded onto the data x context ranks: ``plan.py`` is the entry point and
the whole picture."""
