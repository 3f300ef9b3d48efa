"""Tests of the scaling science: sweeps (spec, plan, ladder, tuning, runs), law fits, backtests and checks."""
