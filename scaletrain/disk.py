"""Failed reads and writes (a full disk above all) as messages that name the file and the cause."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# Below this much free space a failed write is reported as a full disk: torch.save's C++ writer
# reports ENOSPC as "unexpected pos 4224 vs 4116" or "file write failed", without the errno.
NEARLY_FULL_BYTES = 64 << 20
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskWriteError(OSError):
    """A file that could not be written; str() is the user-facing message."""

    def __str__(self) -> str:
        return self.args[0]


def write_failure(path: str | Path, error: BaseException, fix: str = "") -> DiskWriteError:
    """The error to raise for a failed write of `path`: the file, the cause, the free space and the fix."""
    free = free_bytes(Path(path))
    full = (isinstance(error, OSError) and error.errno in FULL_DISK_ERRNOS) or free < NEARLY_FULL_BYTES
    if full:
        cause = "no space left on device"
    elif isinstance(error, OSError) and error.strerror:
        cause = error.strerror
    else:
        cause = str(error).splitlines()[0]
    message = f"could not write {path}: {cause} ({free:,} bytes free on its disk)"
    if full:
        message += "; free space there or point the run elsewhere"
    return DiskWriteError(f"{message}; {fix}" if fix else message)


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds `path`: its nearest existing ancestor (the last of
    `parents`, `/` or `.`, always exists)."""
    existing = next(candidate for candidate in (path, *path.parents) if candidate.exists())
    return shutil.disk_usage(existing).free


def write_atomically(path: Path, payload: bytes) -> None:
    """Write `path` through a staging file renamed over it, so readers find the old contents or the new,
    never half a file (the staging name carries the pid: two writers do not share one)."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_bytes(payload)
    os.replace(partial, path)


def replace_directory(staging: Path, target: Path) -> None:
    """Swap a finished staging directory in for `target`: an old `target` is renamed aside first and
    removed only once the new one is in place, so readers find the old contents or the new, never half."""
    retired = None
    if target.exists():
        retired = target.with_name(f".{target.name}.retired-{os.getpid()}")
        os.rename(target, retired)
    os.rename(staging, target)
    if retired is not None:
        shutil.rmtree(retired)
