"""Data parallel (DDP, ZeRO-1/2/3, HSDP): ``plan.py`` is the entry point and what each zero
level means."""
