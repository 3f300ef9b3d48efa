"""The scaling science: sweeps that train a grid or ladder of runs (sweep/), and the scaling-law fits,
backtests and held-out checks made from their results (fit.py, laws.py, backtest.py, check.py)."""
