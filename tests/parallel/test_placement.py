"""Where ranks run: the per-rank lines and the rule that a TP group stays inside a host."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scaletrain.config import ConfigError
from scaletrain.parallel.groups import Topology
from scaletrain.parallel.layout import Layout
from scaletrain.parallel.placement import RankPlace, check_tensor_parallel_within_hosts, hosts_of, place_lines


def places(hosts: list[str]) -> list[RankPlace]:
    """One rank per entry of `hosts`, local ranks counted per host, in rank order."""
    seen: dict[str, int] = {}
    result = []
    for rank, host in enumerate(hosts):
        result.append(RankPlace(rank, seen.get(host, 0), host, "cpu"))
        seen[host] = seen.get(host, 0) + 1
    return result


def topology(world: int, tensor: int, pipeline: int) -> Topology:
    return Topology(Layout(tensor=tensor, pipeline=pipeline, data=world // (tensor * pipeline)), 0, 0, 0, 0,
                    torch.device("cpu"))


def test_tp_groups_inside_hosts_pass_and_one_across_is_refused_naming_it():
    two_by_two = places(["n1", "n1", "n2", "n2"])
    for tensor in (1, 2):
        check_tensor_parallel_within_hosts(two_by_two, tensor)
    with pytest.raises(ConfigError, match=r"parallel.tensor=4 puts TP group ranks 0-3 on hosts n1, n2: .*"
                                          r"use parallel.tensor <= 2 \(the ranks per node\)"):
        check_tensor_parallel_within_hosts(two_by_two, 4)
    # three ranks per host: TP2's second group (ranks 2-3) straddles the hosts
    with pytest.raises(ConfigError, match="TP group ranks 2-3 on hosts n1, n2"):
        check_tensor_parallel_within_hosts(places(["n1"] * 3 + ["n2"] * 3), 2)


def test_place_lines_give_each_rank_its_host_and_coordinates():
    lines = place_lines(places(["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]), topology(8, 2, 2))
    assert lines[0] == "train: rank 0 (local 0) on n1, cpu; TP 0 DP 0 PP 0"
    assert lines[3] == "train: rank 3 (local 1) on n2, cpu; TP 1 DP 1 PP 0"
    assert lines[6] == "train: rank 6 (local 0) on n4, cpu; TP 0 DP 1 PP 1"
    assert hosts_of(places(["n2", "n2", "n1", "n1"])) == ["n2", "n1"]


def test_place_lines_give_the_expert_parallel_rank_among_the_data_parallel_ones():
    """TP2 x DP4 with EP2: data-parallel ranks 0-1 and 2-3 each split the experts (megatron's groups)."""
    dense = topology(8, 2, 1)
    expert_topology = dataclasses.replace(dense, layout=dataclasses.replace(dense.layout, expert=2))
    lines = place_lines(places(["n1"] * 8), expert_topology)
    assert lines[1].endswith("TP 1 DP 0 PP 0 EP 0")
    assert lines[2].endswith("TP 0 DP 1 PP 0 EP 1")
    assert lines[4].endswith("TP 0 DP 2 PP 0 EP 0")
