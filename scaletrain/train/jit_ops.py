"""DeepSpeed's JIT-built ops: built once per environment, announced, and without the hang a killed build leaves.

Once per environment: torch builds every extension of a user under one root
(~/.cache/torch_extensions/py311_cpu), and ninja rebuilds an op whenever the build commands change;
they name the include paths of the venv that asks, so two venvs on one machine rebuild each other's
op (100-160 s each) for as long as both run (issue 21). Unless the user set TORCH_EXTENSIONS_DIR,
each environment (sys.prefix) gets a root of its own, set in TORCH_EXTENSIONS_DIR for torch to use.

One ninja: torch runs `ninja` from PATH, and pip's ninja in the venv (1.13) and the system's (Debian
1.11) keep .ninja_log in different versions, so each rebuilt the op the other had built (~50 s a time)
whenever runs started with and without the venv's bin on PATH (activated or not, a job script, a
launcher). The environment's own ninja, when it has one, is put first on PATH before any build.

Announced: a first build takes ~90 s on 2 CPU cores with no output; rank 0 says it is coming.
`make install` builds it ahead (`python -m scaletrain.train.jit_ops`), as DeepSpeed's DS_BUILD_OPS
would at pip-install time, so the first run, demo or test of a new environment does not wait on it.

Without the hang: torch's cpp_extension guards each build directory with a lock file (`FileBaton`)
that every process creates while it builds or checks the op and deletes when done; a process killed
in between leaves the file, and every later start waits on it forever with no output. Before
DeepSpeed loads its ops, each rank takes an flock that serialises this node's scaletrain processes,
waits for a lock file that a live build may hold, and removes one that outlived STALE_AFTER_S,
saying so.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.utils.cpp_extension import get_default_build_root

STALE_AFTER_S = 300.0  # a first build takes ~90 s on 2 CPU cores; checking a built op, well under 1 s
CPU_COMM_OP = "ShareMemCommBuilder"  # the op DeepSpeed's comm layer loads on CPU (deepspeed_shm_comm)


def environment_build_root(prefix: str) -> Path:
    """torch's extension root for the environment at `prefix` (its sys.prefix): one directory per
    environment beside torch's shared default, so deleting a venv's build deletes nothing else's."""
    digest = hashlib.sha256(str(Path(prefix).resolve()).encode()).hexdigest()[:12]
    return Path(get_default_build_root()) / f"env-{digest}"


def pin_ninja(prefix: str = sys.prefix) -> None:
    """Put the environment's bin directory first on PATH when it holds a ninja (see the module docstring)."""
    bin_dir = Path(prefix) / "bin"
    if (bin_dir / "ninja").exists():
        entries = os.environ.get("PATH", "").split(os.pathsep)
        if entries[:1] != [str(bin_dir)]:
            os.environ["PATH"] = os.pathsep.join([str(bin_dir), *(entry for entry in entries if entry)])


def pin_build_root() -> Path:
    """TORCH_EXTENSIONS_DIR when the user set it; else this environment's root, set there (torch
    reads it at each build, so it holds for every op DeepSpeed builds in this process). Pins the
    ninja that builds too (pin_ninja)."""
    pin_ninja()
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    root = environment_build_root(sys.prefix)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    return root


def clear_stale_build_locks(stale_after_s: float = STALE_AFTER_S, poll_s: float = 1.0) -> list[Path]:
    """Before DeepSpeed loads its ops: pin this environment's build root, wait out live build locks
    under it, remove stale ones (returned), and on rank 0 announce a build that is about to start."""
    root = pin_build_root()
    root.mkdir(parents=True, exist_ok=True)
    removed = []
    with (root / ".scaletrain.lock").open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for baton in sorted(root.glob("*/lock")):  # torch builds op NAME in $TORCH_EXTENSIONS_DIR/NAME
            if _wait_or_remove(baton, stale_after_s, poll_s):
                removed.append(baton)
    _announce_build(root)
    return removed


def _wait_or_remove(baton: Path, stale_after_s: float, poll_s: float) -> bool:
    """Wait until a live build deletes `baton`; True when it was stale and removed here instead."""
    announced = False
    while baton.exists():
        age = time.time() - baton.stat().st_mtime
        if age >= stale_after_s:
            baton.unlink(missing_ok=True)
            print(f"removed {baton}, a lock left by a JIT build of a DeepSpeed op that was killed "
                  f"{age:.0f} s ago", file=sys.stderr, flush=True)
            return True
        if not announced:
            print(f"waiting for {baton} (a DeepSpeed op is being built; the lock counts as stale "
                  f"after {stale_after_s:.0f} s)", file=sys.stderr, flush=True)
            announced = True
        time.sleep(poll_s)
    return False


def _announce_build(root: Path) -> None:
    """On rank 0 (or alone), one line when DeepSpeed is about to JIT-build its CPU op under `root`."""
    op_name = _op_to_build(root)
    if op_name and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"compiling DeepSpeed's CPU op {op_name} (first run in this environment, ~90 s)",
              file=sys.stderr, flush=True)


def _op_to_build(root: Path) -> str | None:
    """The name of DeepSpeed's CPU comm op when its comm layer will JIT-build it under `root`: on this
    accelerator it has one, it is compatible and not pre-installed (DeepSpeed 0.19 comm/torch.py
    build_shm_op, op_builder/builder.py OpBuilder.load), and torch's library of it is not there yet."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder(CPU_COMM_OP)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    if installed_ops.get(builder.NAME, False) or (root / builder.NAME / f"{builder.NAME}.so").exists():
        return None
    return builder.NAME


def build_ahead() -> str | None:
    """Build DeepSpeed's CPU comm op into this environment's root now (the name built, None when
    there is nothing to build): what the first DeepSpeed engine of this environment would do."""
    clear_stale_build_locks()
    op_name = _op_to_build(pin_build_root())
    if op_name is not None:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().create_op_builder(CPU_COMM_OP).load(verbose=False)
    return op_name


if __name__ == "__main__":
    built, root = build_ahead(), pin_build_root()
    print(f"built DeepSpeed's CPU op {built} under {root}" if built
          else f"DeepSpeed's CPU op needs no build here ({root})")
