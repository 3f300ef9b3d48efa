"""Scaling-law sweeps: a spec (spec.py) expands into runs (plan.py), which executors train
(executors.py) and whose results (results.py) are fitted and logged at the end (finalize.py);
commands.py is the `scaletrain sweep` command line."""
