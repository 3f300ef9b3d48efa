"""The surviving ranks name exactly the lost one (parallel/peer_loss.py rank_lost), with real gloo
processes on one host, where gloo's error names an address that every rank shares: rank 0 killed (the
rendezvous store goes with it, as under scaletrain-torchrun) and rank 1 stopped (SIGSTOP) past the
timeout. Exactly one survivor per host says it. The multi-host faults are in tests/launch/test_multinode.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scaletrain.parallel.groups import Topology
from scaletrain.parallel.layout import Layout
from scaletrain.parallel.peer_loss import is_peer_failure, rank_lost
from scaletrain.parallel.placement import gather_places
from tests.warm import fork_server

WORLD_SIZE = 3
TIMEOUT_S = 4.0


def _rank(rank: int, port: int, results: Path) -> None:
    """All-reduce until a peer is lost, then write what rank_lost says and exit as the loop would (76)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=TIMEOUT_S))
    places = gather_places(Topology(Layout(data=WORLD_SIZE), rank, 0, rank, 0, torch.device("cpu")))
    (results / f"ready{rank}").write_text(str(os.getpid()))
    try:
        while True:
            dist.all_reduce(torch.ones(256))
    except RuntimeError as error:
        lost = rank_lost(error, places, TIMEOUT_S, rank)
        (results / f"rank{rank}.json").write_text(json.dumps(
            {"peer_failure": is_peer_failure(error), "message": str(lost), "reports": lost.reports}))
    os._exit(76)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_and_lose(results: Path, lose: int, how: signal.Signals) -> dict[int, dict]:
    """Start the ranks, send rank `lose` the signal `how` once all are in the loop; what the others said."""
    context = fork_server()
    port = _free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, results)) for rank in range(WORLD_SIZE)]
    for process in ranks:
        process.start()
    try:
        deadline = time.monotonic() + 120
        while not all((results / f"ready{rank}").exists() for rank in range(WORLD_SIZE)):
            assert time.monotonic() < deadline and all(process.exitcode is None for process in ranks)
            time.sleep(0.05)
        time.sleep(0.2)
        os.kill(ranks[lose].pid, how)
        survivors = [process for rank, process in enumerate(ranks) if rank != lose]
        for process in survivors:
            process.join(timeout=60)
        assert [process.exitcode for process in survivors] == [76] * len(survivors)
    finally:
        for process in ranks:
            process.kill()
            process.join(timeout=30)
    return {rank: json.loads((results / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)
            if rank != lose}


@pytest.mark.serial  # a 4-second timeout: a survivor starved of CPU by other tests would miss the roll call too
@pytest.mark.parametrize("lose, how, noticed", [
    (0, signal.SIGKILL, "its connection was closed"),
    (1, signal.SIGSTOP, f"no answer within parallel.timeout_s={TIMEOUT_S:g} s"),
], ids=["rank 0 killed", "rank 1 stopped"])
def test_the_survivors_name_exactly_the_lost_rank_and_one_of_them_says_it(
    tmp_path: Path, lose: int, how: signal.Signals, noticed: str
):
    said = _run_and_lose(tmp_path, lose, how)
    host = socket.gethostname()
    address = socket.gethostbyname(host)
    for rank, record in said.items():
        assert record["peer_failure"], record
        assert record["message"].startswith(f"rank {rank} on {host}: lost contact with {host} ({address}, rank "
                                            f"{lose})"), record["message"]
        assert noticed in record["message"], record["message"]
    assert [rank for rank, record in said.items() if record["reports"]] == [min(said)]
