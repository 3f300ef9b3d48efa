"""Durations as every command writes them: training lines (elapsed, ETA), `sweep plan` (predicted
times) and `sweep status` (wall times)."""

from __future__ import annotations


def format_duration(seconds: float) -> str:
    """42 -> 0m42s, 3725 -> 1h02m: seconds under an hour, minutes above."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
