"""Choosing hyperparameters: sweeps of short proxy runs (grid, sweep) and the planner's arithmetic
(plan, scaling_laws)."""
