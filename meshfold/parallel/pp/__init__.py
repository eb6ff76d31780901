"""Pipeline parallel: the executor (``executor.py``), its point-to-point plan
(``p2p_plan.py``), the stage modules (``stage_modules.py``), the orders a run executes
(``run_orders.py``) and the timeline's file and drawing (``timeline_plot.py``). The
schedules themselves are core objects (``meshfold/schedules``). This init imports
nothing, so the pure parts load without torch."""
