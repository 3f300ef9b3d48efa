"""The one exception type for data problems a user can fix (missing files, corruption, bad settings)."""

from __future__ import annotations

_WORKER_PREFIX = "Caught DataError in DataLoader worker"


class DataError(ValueError):
    """A data problem the user can fix; the message names the file or value and says how.

    A DataLoader worker's exception reaches the main process as `DataError(text)` where text is
    torch's "Caught DataError in DataLoader worker process N. Original Traceback ..." followed by
    the worker's traceback (torch/_utils.py, ExceptionWrapper.reraise); the message keeps only
    the worker's own message and which worker, so the user reads one clear line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(_worker_message(message) if message.startswith(_WORKER_PREFIX) else message)


def _worker_message(wrapped: str) -> str:
    where = wrapped.split(".", 1)[0].removeprefix("Caught DataError ")
    marker = "DataError: "
    if marker not in wrapped:
        return wrapped
    return f"{wrapped.rsplit(marker, 1)[1].strip()} ({where})"
