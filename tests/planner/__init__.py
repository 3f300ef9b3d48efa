"""Tests of the layout planner: exact parameter counts, memory vs real CPU runs, the 175B question."""
