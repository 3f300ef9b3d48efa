"""torchrun across hosts (issue 23): two hosts made of network namespaces (tests/hosts.py), each running
its own torchrun agent with two ranks, meet by c10d rendezvous on n1 (`launch/torchrun.sh` with NNODES
and RDZV_ENDPOINT, as the README says) or statically (torchrun's node rank and master address) and
train the single-rank model: DP across the hosts, and TP2 inside each host x DP2
across them. Every process is a fresh interpreter in its host's namespace (a warm fork would run in
the test's own network namespace)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hosts import Hosts, make_hosts, missing_requirement
from tests.train.runs import DEMO_CONFIG, REPO, run_scaletrain, tiny_overrides
from tests.train.test_layouts import STEPS, LayoutRuns, assert_matches_single_rank

pytestmark = pytest.mark.slow

RANKS_PER_HOST = 2
RUN_TIMEOUT_S = 300
TRAINING = [f"train.steps={STEPS}", "train.eval_every=10"]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    reason = missing_requirement()
    if reason is not None:
        pytest.skip(reason)
    with make_hosts(2, tmp_path_factory.mktemp("hosts")) as made:
        yield made


@pytest.fixture(scope="module")
def single_rank(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> LayoutRuns:
    run_dir = tmp_path_factory.mktemp("single_rank") / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), *TRAINING])
    return LayoutRuns(run_dir, run_dir)


def torchrun_on_hosts(hosts: Hosts, rendezvous: str, run_dir: Path, overrides: list[str],
                      data_dir: Path, expected_exits: tuple[set[int], ...] = ({0}, {0})) -> dict[str, str]:
    """One torchrun agent per host, RANKS_PER_HOST ranks each, training the tiny GPT into `run_dir`;
    fails with every host's output unless each agent exits with one of its `expected_exits` within
    RUN_TIMEOUT_S. Returns each host's output by name."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true",
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    arguments = [str(DEMO_CONFIG), *tiny_overrides(data_dir, run_dir), *TRAINING, *overrides]
    agents = []
    for node_rank, host in enumerate(hosts.hosts):
        if rendezvous == "c10d":  # the documented multi-node command, the same on every host
            environment.update(NNODES=str(len(hosts)), RDZV_ENDPOINT=f"{hosts[0].name}:29400", RDZV_ID=run_dir.name)
            command = [str(REPO / "launch" / "torchrun.sh"), str(RANKS_PER_HOST), *arguments]
        else:  # torchrun's static rendezvous: node rank and master address given
            command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}",
                       f"--nproc_per_node={RANKS_PER_HOST}", f"--node_rank={node_rank}",
                       f"--master_addr={hosts[0].name}", "--master_port=29500", "-m", "scaletrain", "train",
                       *arguments]
        log = (run_dir.parent / f"{host.name}.log").open("w")
        agents.append((host, log, hosts.popen(host, command, cwd=REPO, env=dict(environment), stdout=log,
                                              stderr=subprocess.STDOUT)))
    failures = []
    for (host, log, agent), expected_exit in zip(agents, expected_exits, strict=True):
        try:
            code = agent.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # the harness ends what is left
            code = f"nothing within {RUN_TIMEOUT_S} s"
        log.close()
        if code not in expected_exit:
            failures.append(f"{host.name} exited {code}")
    outputs = {host.name: Path(log.name).read_text() for host, log, _ in agents}
    if failures:
        shown = "\n".join(f"--- {name} ---\n{output[-3000:]}" for name, output in outputs.items())
        raise AssertionError(f"torchrun across hosts: {'; '.join(failures)}, expected {expected_exits}:\n{shown}")
    return outputs


@pytest.mark.parametrize("rendezvous, layout, overrides", [
    ("c10d", "dp4", ["train.micro_batch_size=2"]),
    ("c10d", "tp2_dp2", ["parallel.tensor=2"]),
    ("static", "tp2_dp2", ["parallel.tensor=2"]),
], ids=["c10d: DP across two hosts", "c10d: TP2 inside each host x DP2 across", "static: TP2 x DP2"])
def test_torchrun_across_two_hosts_trains_the_single_rank_model(
    hosts: Hosts, single_rank: LayoutRuns, small_dataset: Path, tmp_path: Path, rendezvous: str, layout: str,
    overrides: list[str],
) -> None:
    run_dir = tmp_path / f"{rendezvous}_{layout}"
    output = "\n".join(torchrun_on_hosts(hosts, rendezvous, run_dir, overrides, small_dataset).values())
    assert_matches_single_rank(LayoutRuns(run_dir, run_dir), single_rank)
    assert f"finished: {STEPS} steps" in output
    # rank 0 says where every rank runs: two consecutive ranks per host, each TP pair on one host
    places = dict(re.findall(r"^train: rank (\d) \(local \d\) on (n\d), cpu;", output, flags=re.MULTILINE))
    assert sorted(places) == ["0", "1", "2", "3"], output[-3000:]
    assert places["0"] == places["1"] != places["2"] == places["3"]


def test_a_tp_group_across_hosts_is_refused_before_anything_is_written(
    hosts: Hosts, small_dataset: Path, tmp_path: Path
) -> None:
    """TP4 over 2 hosts x 2 ranks would all-reduce every layer across the network: every rank stops
    with exit 2, rank 0 saying which group spans which hosts and what to set instead. n1 hosts the
    rendezvous store and rank 0 (c10d orders the nodes by hostname): its agent exits 2 with that one
    line. n2's agent either sees its ranks' exit 2 first (exit 2), or loses the store as n1's agent
    ends and says so in one line (exit 1); no traceback either way."""
    run_dir = tmp_path / "tp4"
    outputs = torchrun_on_hosts(hosts, "c10d", run_dir, ["parallel.tensor=4", "model.num_heads=4"], small_dataset,
                                expected_exits=({2}, {1, 2}))
    errors = [line for line in outputs["n1"].splitlines() if line.startswith("scaletrain train: error:")]
    assert errors == ["scaletrain train: error: parallel.tensor=4 puts TP group ranks 0-3 on hosts n1, n2: a TP group "
                      "must stay inside a node (it all-reduces every layer); use parallel.tensor <= 2 (the ranks per "
                      "node), dividing it, or more ranks per node"], outputs["n1"][-3000:]
    assert ("scaletrain-torchrun: lost the rendezvous store at n1:29400" in outputs["n2"]
            or "scaletrain train: error: parallel.tensor=4" in outputs["n2"]), outputs["n2"][-3000:]
    assert "Traceback" not in outputs["n1"] + outputs["n2"]
    assert not run_dir.exists()


def test_each_host_has_its_own_name_and_reaches_only_the_others(tmp_path: Path) -> None:
    """The harness itself: hostnames n1/n2, each resolving the other to its 10.77.0.x address, a single
    route (the hosts' subnet: no way off the machine), and nothing left once the hosts are removed."""
    reason = missing_requirement()
    if reason is not None:
        pytest.skip(reason)
    with make_hosts(2, tmp_path / "hosts") as made:
        namespaces = {host.namespace for host in made.hosts} | {made.bridge}
        for host, other in ((made[0], made[1]), (made[1], made[0])):
            assert made.run(host, ["hostname"]).stdout.strip() == host.name
            assert made.run(host, ["getent", "hosts", other.name]).stdout.split()[:2] == [other.address, other.name]
            assert made.run(host, ["ip", "route"]).stdout.splitlines() == [
                f"10.77.0.0/24 dev eth0 proto kernel scope link src {host.address} "]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not namespaces & {line.split()[0] for line in listed.splitlines() if line.strip()}
