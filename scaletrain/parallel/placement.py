"""Where each rank runs: gathered once at start-up, said by rank 0 (a line per rank), recorded among the
run's facts (the W&B config), and checked.

The check: a tensor-parallel group must not span hosts. TP all-reduces activations twice per layer
(Shoeybi et al. 2019, sec. 3), so it is placed on the fastest links, inside a node (Narayanan et al.
2021, sec. 3.3); across hosts every layer would wait on the network. Ranks are numbered node by node
(torchrun, and SLURM with one task per rank) and TP is the fastest-varying coordinate, so TP groups
stay inside nodes whenever parallel.tensor divides the ranks per node.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from scaletrain.config import ConfigError
from scaletrain.parallel.groups import Topology


@dataclass(frozen=True)
class RankPlace:
    rank: int
    local_rank: int
    host: str
    device: str
    address: str = ""  # the host name's address, which gloo advertises (and names in its errors)
    pid: int = 0  # its process on that host (0: not known), for the ranks beside it to tell if it still runs


def gather_places(topology: Topology) -> list[RankPlace]:
    """Every rank's place, in rank order, on every rank (one all_gather_object at start-up)."""
    host = socket.gethostname()
    mine = RankPlace(topology.rank, int(os.environ.get("LOCAL_RANK", 0)), host, str(topology.device), _address(host),
                     os.getpid())
    if topology.world_size == 1:
        return [mine]
    places: list[RankPlace | None] = [None] * topology.world_size
    dist.all_gather_object(places, mine)
    return [place for place in places if place is not None]


def _address(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return ""


def planned_places(world_size: int, ranks_per_node: int) -> list[RankPlace]:
    """The places a launcher will give: ranks numbered node by node (torchrun's node ranks, SLURM's
    block distribution), hosts named node1, node2, ... as `scaletrain check` knows no real names."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ConfigError(f"--ranks-per-node {ranks_per_node} does not divide --world-size {world_size}; give the "
                          "ranks each node starts (its GPUs), with the world size a multiple of it")
    return [RankPlace(rank, rank % ranks_per_node, f"node{rank // ranks_per_node + 1}", "")
            for rank in range(world_size)]


def check_tensor_parallel_within_hosts(places: list[RankPlace], tensor_parallel_size: int) -> None:
    """ConfigError naming the first TP group whose ranks are on more than one host."""
    for start in range(0, len(places), tensor_parallel_size):
        group = places[start:start + tensor_parallel_size]
        hosts = hosts_of(group)
        if len(hosts) > 1:
            per_host = min(sum(place.host == host for place in places) for host in hosts_of(places))
            raise ConfigError(
                f"parallel.tensor={tensor_parallel_size} puts TP group ranks {group[0].rank}-{group[-1].rank} on "
                f"hosts {', '.join(hosts)}: a TP group must stay inside a node (it all-reduces every layer); "
                f"use parallel.tensor <= {per_host} (the ranks per node), dividing it, or more ranks per node")


def hosts_of(places: list[RankPlace]) -> list[str]:
    """The distinct hosts, in rank order."""
    return list(dict.fromkeys(place.host for place in places))


def place_lines(places: list[RankPlace], topology: Topology) -> list[str]:
    """One line per rank: its local rank, host and device, and its TP/CP/DP/PP coordinates (TP fastest;
    CP only when the layout has it), and its expert-parallel rank under EP."""
    tensor, context, data = topology.tensor_parallel_size, topology.context_parallel_size, topology.data_parallel_size
    expert = topology.expert_parallel_size  # its rank among the DP ranks splitting the experts (DP rank % EP)
    return [f"train: rank {place.rank} (local {place.local_rank}) on {place.host}, {place.device}; "
            f"TP {place.rank % tensor} "
            + (f"CP {place.rank // tensor % context} " if context > 1 else "")
            + f"DP {place.rank // (tensor * context) % data} PP {place.rank // (tensor * context * data)}"
            + (f" EP {place.rank // (tensor * context) % data % expert}" if expert > 1 else "")
            for place in places]
