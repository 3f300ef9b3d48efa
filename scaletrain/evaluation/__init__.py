"""Downstream evaluation of a model: lm-evaluation-harness tasks on scaletrain's own model (harness.py, over
scoring.py, which needs no harness), `scaletrain eval --tasks` (downstream.py), and the local tasks' data built
from a prepared dataset's held-out split (task_data.py)."""
