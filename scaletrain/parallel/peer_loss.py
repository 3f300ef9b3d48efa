"""A rank lost mid-run: its process killed or crashed, or its host cut off. Say which, and stop.

Every other rank learns of it from the collective it is in. A dead process closes its TCP connections,
so gloo fails at once ("Connection reset by peer", ~2 s on the namespace hosts of the tests); a host
whose link is down answers nothing, so gloo fails once the process group's timeout passes
(parallel.timeout_s: TCP's "Connection timed out", or gloo's own "Timed out waiting ... for recv" when
its timeout comes first). gloo's TCP errors name the peer's address, which the ranks' places (gathered
at start-up, parallel/placement.py) map to a host and the ranks that run there. When the error names no
peer (gloo's own timeout; NCCL's errors never do), the ranks take a roll call on the rendezvous store: each that
can writes its rank, waits ROLL_CALL_S, and the ranks that did not answer are named as lost (a rank cut
off from the store's host cannot answer and names everyone it could not reach).

The run then stops with EXIT_RANK_LOST, which launch/slurm.sbatch requeues and torchrun's
--max-restarts restarts: the next start resumes from the last checkpoint. A checkpoint being written
when the peer went is never the one resumed from (checkpoints are published complete, by rename).
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kept light: scaletrain-torchrun imports EXIT_RANK_LOST without torch.distributed
    from scaletrain.parallel.placement import RankPlace

ROLL_CALL_S = 3.0  # how long a rank waits for the others' answers once a collective has failed

EXIT_RANK_LOST = 76  # sysexits.h EX_PROTOCOL: a remote party failed; resumable from the last checkpoint

# gloo: "Read error [10.77.0.2]:18627: Connection reset by peer", "[10.77.0.1]:15753: Connection timed out"
_PEER = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")
_DEAD = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")
_SILENT = ("timed out", "timeout")


class RankLost(RuntimeError):
    """A collective failed because another rank is gone; the message says which rank noticed, on which
    host, who is lost and what is known."""


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that failed on another rank's side (not a bug of this rank)."""
    text = str(error).lower()
    from_backend = type(error).__name__ in {"DistBackendError", "DistNetworkError"} or "gloo" in text or "nccl" in text
    return from_backend and any(marker in text for marker in (*_DEAD, *_SILENT))


def describe_lost(error: BaseException, places: list[RankPlace], timeout_s: float, rank: int) -> str:
    """One sentence: the host whose rank(s) went (with the ranks it ran), how it was noticed, what next."""
    text = str(error)
    addresses = list(dict.fromkeys(_PEER.findall(text)))
    if addresses:
        named = [[place for place in places if place.address == address] for address in addresses]
        where = "; ".join(_on_hosts(ranks) if ranks else address
                          for address, ranks in zip(addresses, named, strict=True))
    else:
        missing = unanswered_ranks(rank, len(places))
        if missing:
            where = (f"{_on_hosts([places[other] for other in missing])}, which did not answer a roll call "
                     f"within {ROLL_CALL_S:g} s")
        else:
            where = "another rank (the backend's error names none, and the rendezvous store did not answer)"
    lowered = text.lower()
    if any(marker in lowered for marker in _DEAD):
        how = "its connection was closed: a process there exited or was killed"
    else:
        how = (f"no answer within parallel.timeout_s={timeout_s:g} s: the host or its link is down, or a rank "
               "there hangs")
    return (f"lost contact with {where}: {how}. Stopping (exit {EXIT_RANK_LOST}); a restart resumes from the "
            f"last checkpoint")


def _on_hosts(lost: list[RankPlace]) -> str:
    """`n2 (10.77.0.2, ranks 2, 3)`, host by host."""
    hosts = dict.fromkeys(place.host for place in lost)
    return "; ".join(
        f"{host} ({next(place.address for place in lost if place.host == host) or 'address unknown'}, ranks "
        f"{', '.join(str(place.rank) for place in lost if place.host == host)})" for host in hosts)


def unanswered_ranks(rank: int, world_size: int, grace_s: float = ROLL_CALL_S) -> list[int]:
    """The ranks that did not write their answer to the rendezvous store within `grace_s` (this one
    answers first); [] when the store itself cannot be reached."""
    import torch.distributed.distributed_c10d as c10d

    attempt = f"{os.environ.get('SLURM_RESTART_COUNT', 0)}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    keys = [f"scaletrain/roll_call/{attempt}/{other}" for other in range(world_size)]
    try:
        store = c10d._get_default_store()
        store.set_timeout(timedelta(seconds=grace_s))
        store.set(keys[rank], "here")
        time.sleep(grace_s)
        return [other for other in range(world_size) if not store.check([keys[other]])]
    except Exception:  # noqa: BLE001 - a store that is gone names nobody; the caller says so
        return []
