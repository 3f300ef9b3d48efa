"""DeepSpeed's JIT-built ops without the hang a killed build leaves behind.

torch's cpp_extension guards each build directory with a lock file (`FileBaton`) that every process
creates while it builds or checks the op and deletes when done; a process killed in between leaves
the file, and every later start waits on it forever with no output. Before DeepSpeed loads its ops,
each rank takes an flock that serialises this node's scaletrain processes, waits for a lock file
that a live build may hold, and removes one that outlived STALE_AFTER_S, saying so.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

from torch.utils.cpp_extension import get_default_build_root

STALE_AFTER_S = 300.0  # a first build takes ~90 s on 2 CPU cores; checking a built op, well under 1 s


def clear_stale_build_locks(stale_after_s: float = STALE_AFTER_S, poll_s: float = 1.0) -> list[Path]:
    """Wait out live build locks under torch's extension root, remove stale ones; returns those removed."""
    # torch builds in $TORCH_EXTENSIONS_DIR/NAME, else in ~/.cache/torch_extensions/py311_cpu/NAME
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    if not root.is_dir():
        return []
    removed = []
    with (root / ".scaletrain.lock").open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for baton in sorted({*root.glob("*/lock"), *root.glob("*/*/lock")}):
            announced = False
            while baton.exists():
                age = time.time() - baton.stat().st_mtime
                if age >= stale_after_s:
                    baton.unlink(missing_ok=True)
                    removed.append(baton)
                    print(f"removed {baton}, a lock left by a JIT build of a DeepSpeed op that was killed "
                          f"{age:.0f} s ago", file=sys.stderr, flush=True)
                    break
                if not announced:
                    print(f"waiting for {baton} (a DeepSpeed op is being built; the lock counts as stale "
                          f"after {stale_after_s:.0f} s)", file=sys.stderr, flush=True)
                    announced = True
                time.sleep(poll_s)
    return removed
