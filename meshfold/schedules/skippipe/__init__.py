"""SkipPipe (partial and reordered pipelining, Apostolov et al. 2025): 1F1B's layout with
per-micro-batch paths. ``paths.py`` plans the paths (pure: the planner prices them too),
``schedule.py`` is the registered schedule object; the executor's side (the tables a run
plans with, from the config) is ``parallel/pp/run_orders.py``'s generic ``RunFacts``."""
