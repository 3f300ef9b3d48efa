"""A rank lost mid-run: its process killed or crashed, or its host cut off. Say which, and stop.

Every other rank learns of it from the collective it is in. A dead process closes its TCP connections,
so gloo fails at once ("Connection reset by peer", ~2 s on the namespace hosts of the tests); a host
whose link is down answers nothing, so gloo fails once the process group's timeout passes
(parallel.timeout_s: TCP's "Connection timed out", or gloo's own "Timed out waiting ... for recv" when
its timeout comes first). gloo's TCP errors name the peer's address, which the ranks' places (gathered
at start-up, parallel/placement.py) map to a host and the ranks that run there; that host may run this rank
too, and the named peer may be one that only waited on the lost rank and has exited since. So the ranks
take a roll call on the rendezvous store: each that can writes its rank, waits ROLL_CALL_S, and the ranks
that did not answer are the lost ones (of those at the error's address, if it names one). A store that
does not answer is gone with the process that hosts it, rank 0 (or torchrun's agent on rank 0's node):
then rank 0 is named, with the ranks of another host whose address the error names.

Every surviving rank knows; the first surviving rank of each host says it (RankLost.reports): each host
says it once, the one that lost rank 0 too.

The run then stops with EXIT_RANK_LOST, which launch/slurm.sbatch requeues and torchrun's
--max-restarts restarts: the next start resumes from the last checkpoint. A checkpoint being written
when the peer went is never the one resumed from (checkpoints are published complete, by rename).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from datetime import timedelta
from pathlib import Path
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
    host, who is lost and what is known. `reports`: whether this rank says it for its host (rank_lost)."""

    def __init__(self, message: str, reports: bool = True) -> None:
        super().__init__(message)
        self.reports = reports


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that failed on another rank's side (not a bug of this rank)."""
    text = str(error).lower()
    from_backend = type(error).__name__ in {"DistBackendError", "DistNetworkError"} or "gloo" in text or "nccl" in text
    return from_backend and any(marker in text for marker in (*_DEAD, *_SILENT))


def rank_lost(error: BaseException, places: list[RankPlace], timeout_s: float, rank: int) -> RankLost:
    """The RankLost that `rank` raises for the collective's `error`. It reports (one line per host) when it is
    the first rank of its host that is not lost: rank 0 may be the one that went."""
    lost, note = lost_ranks(error, places, rank)
    here = places[rank].host
    reports = rank == min(place.rank for place in places if place.host == here and place not in lost)
    return RankLost(f"rank {rank} on {here}: {_sentence(error, lost, note, timeout_s)}", reports)


def describe_lost(error: BaseException, places: list[RankPlace], timeout_s: float, rank: int) -> str:
    """One sentence: the host whose rank(s) went (with the ranks it ran), how it was noticed, what next."""
    return _sentence(error, *lost_ranks(error, places, rank), timeout_s)


def lost_ranks(error: BaseException, places: list[RankPlace], rank: int) -> tuple[list[RankPlace], str]:
    """The lost ranks, never this one, and a note on how they were found: said after them, or in place of
    them when none is found.

    gloo's error names the peer's address, which all the ranks of its host share, and may name a rank that
    only waited on the lost one and has exited since; the roll call tells them apart. A store that does not
    answer is gone with its host, rank 0 (or torchrun's agent on rank 0's node): then rank 0 is lost, and
    with it the ranks of another host whose address the error names."""
    addresses = set(_PEER.findall(str(error)))
    others = [place for place in places if place.rank != rank]
    suspects = [place for place in others if place.address in addresses]
    here = places[rank].host
    # rank 0 seen gone from this host: its store is too, and a roll call would only wait for an error
    store_gone = rank != 0 and places[0].host == here and not _still_runs(places[0].pid)
    missing = None if store_gone else unanswered_ranks(rank, len(places), round_id=f"{places[0].host}:{places[0].pid}")
    if missing is not None:
        if named := [place for place in suspects if place.rank in missing]:
            return named, ""
        if unanswered := [place for place in others if place.rank in missing]:
            return unanswered, f", which did not answer a roll call within {ROLL_CALL_S:g} s"
        return suspects, "" if suspects else "the backend's error names none, and every rank answered a roll call"
    lost = [place for place in others if place.rank == 0 or (place.host != here and place in suspects)]
    return lost, "" if lost else "the backend's error names none, and the rendezvous store did not answer"


def _sentence(error: BaseException, lost: list[RankPlace], note: str, timeout_s: float) -> str:
    where = _on_hosts(lost) + note if lost else f"another rank ({note})"
    if any(marker in str(error).lower() for marker in _DEAD):
        how = "its connection was closed: a process there exited or was killed"
    else:
        how = (f"no answer within parallel.timeout_s={timeout_s:g} s: the host or its link is down, or a rank "
               "there hangs")
    return (f"lost contact with {where}: {how}. Stopping (exit {EXIT_RANK_LOST}); a restart resumes from the "
            f"last checkpoint")


def _on_hosts(lost: list[RankPlace]) -> str:
    """`n2 (10.77.0.2, ranks 2, 3)`, host by host."""
    hosts = dict.fromkeys(place.host for place in lost)
    described = []
    for host in hosts:
        ranks = [str(place.rank) for place in lost if place.host == host]
        address = next(place.address for place in lost if place.host == host) or "address unknown"
        described.append(f"{host} ({address}, rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)})")
    return "; ".join(described)


def _still_runs(pid: int) -> bool:
    """Whether process `pid` of this host runs: not exited, not a zombie, not stopped; True when not known."""
    if not pid:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    return state not in ("Z", "X", "T", "t")


def unanswered_ranks(rank: int, world_size: int, grace_s: float = ROLL_CALL_S, round_id: str = "") -> list[int] | None:
    """The ranks that did not write their answer to the rendezvous store within `grace_s` (this one
    answers first; an answer stays in the store, so a rank that answered and then exited counts as having
    answered); None when the store itself cannot be reached. `round_id` tells this start's roll call from
    an earlier one's in a store that outlived it (the c10d agent's, which a restart after a membership
    change reuses under the same restart count).

    Rank 0, whose process hosts the store (unless torchrun's agent does), then waits up to `grace_s` for
    the ranks that answered to have read the answers too: once it exits, a roll call still being taken
    finds no store."""
    import torch.distributed.distributed_c10d as c10d

    attempt = f"{os.environ.get('SLURM_RESTART_COUNT', 0)}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    prefix = f"scaletrain/roll_call/{attempt}/{round_id}"
    try:
        store = c10d._get_default_store()
        store.set_timeout(timedelta(seconds=grace_s))
        store.set(f"{prefix}/{rank}", "here")
        time.sleep(grace_s)
        missing = [other for other in range(world_size) if not store.check([f"{prefix}/{other}"])]
        store.set(f"{prefix}/{rank}/read", "done")
    except Exception:  # noqa: BLE001 - a store that is gone names nobody; the caller says so
        return None
    if rank == 0:
        with contextlib.suppress(Exception):  # a rank that answered and was lost since: stop waiting at grace_s
            store.wait([f"{prefix}/{other}/read" for other in range(world_size) if other not in missing])
    return missing
