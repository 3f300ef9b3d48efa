"""torchrun across hosts (issue 23): two hosts made of network namespaces (tests/hosts.py), each running
its own torchrun agent with two ranks, meet by c10d rendezvous on n1 (`launch/torchrun.sh` with NNODES
and RDZV_ENDPOINT, as the README says) or statically (torchrun's node rank and master address) and
train the single-rank model: DP across the hosts, and TP2 inside each host x DP2
across them. Every process is a warm fork (tests/warm.py) that entered its host's namespaces: the agents
start `scaletrain-torchrun` / `python` from warm_bin(), first on their PATH."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from tests.hosts import Host, Hosts, make_hosts, missing_requirement
from tests.slurm_cluster import start_slurm_cluster
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    WARM_CLIENT,
    read_metrics,
    run_scaletrain,
    tiny_overrides,
    wait_for_checkpoint,
    wait_for_step,
)
from tests.train.test_layouts import STEPS, LayoutRuns, assert_matches_single_rank
from tests.warm import warm_bin, warm_environment

pytestmark = [pytest.mark.slow, pytest.mark.serial]

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


@dataclass
class Agent:
    host: Host
    log: Path
    process: subprocess.Popen


def start_torchrun(hosts: Hosts, rendezvous: str, run_dir: Path, overrides: list[str], data_dir: Path,
                   environment: dict[str, str] | None = None) -> list[Agent]:
    """One torchrun agent per host, RANKS_PER_HOST ranks each, training the tiny GPT into `run_dir`
    (each host's output in RUN_DIR/../HOST.log, appended to by a later start)."""
    environment = warm_environment({
        **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **(environment or {})})
    arguments = [str(DEMO_CONFIG), *tiny_overrides(data_dir, run_dir), *TRAINING, *overrides]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    agents = []
    for node_rank, host in enumerate(hosts.hosts):
        if rendezvous == "c10d":  # the documented multi-node command, the same on every host
            environment.update(NNODES=str(len(hosts)), RDZV_ENDPOINT=f"{hosts[0].name}:29400", RDZV_ID=run_dir.name)
            command = [str(REPO / "launch" / "torchrun.sh"), str(RANKS_PER_HOST), *arguments]
        else:  # torchrun's static rendezvous: node rank and master address given
            command = [str(warm_bin() / "python"), "-m", "torch.distributed.run", f"--nnodes={len(hosts)}",
                       f"--nproc_per_node={RANKS_PER_HOST}", f"--node_rank={node_rank}",
                       f"--master_addr={hosts[0].name}", "--master_port=29500", "-m", "scaletrain", "train",
                       *arguments]
        log = run_dir.parent / f"{host.name}.log"
        with log.open("a") as output:
            agents.append(Agent(host, log, hosts.popen(host, command, cwd=REPO, env=dict(environment), stdout=output,
                                                       stderr=subprocess.STDOUT)))
    return agents


def finish(agents: list[Agent], expected_exits: tuple[set[int], ...], timeout_s: float = RUN_TIMEOUT_S
           ) -> dict[str, tuple[int, float, str]]:
    """Wait for every agent; fail with every host's output unless each exits with one of its
    `expected_exits` within `timeout_s`. Each host's (exit code, seconds waited, output) by name."""
    started, results, failures = time.monotonic(), {}, []
    for agent, expected_exit in zip(agents, expected_exits, strict=True):
        try:
            code = agent.process.wait(timeout=max(timeout_s - (time.monotonic() - started), 0.1))
        except subprocess.TimeoutExpired:  # the harness ends what is left
            code = f"nothing within {timeout_s:.0f} s"
        results[agent.host.name] = (code, time.monotonic() - started, agent.log.read_text())
        if code not in expected_exit:
            failures.append(f"{agent.host.name} exited {code}")
    if failures:
        shown = "\n".join(f"--- {name} ---\n{output[-3000:]}" for name, (_, _, output) in results.items())
        raise AssertionError(f"torchrun across hosts: {'; '.join(failures)}, expected {expected_exits}:\n{shown}")
    return results


def torchrun_on_hosts(hosts: Hosts, rendezvous: str, run_dir: Path, overrides: list[str],
                      data_dir: Path, expected_exits: tuple[set[int], ...] = ({0}, {0})) -> dict[str, str]:
    """start_torchrun, then finish: each host's output by name."""
    results = finish(start_torchrun(hosts, rendezvous, run_dir, overrides, data_dir), expected_exits)
    return {name: output for name, (_, _, output) in results.items()}


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


# Long enough to be cut mid-run on this 2-core box (~0.1 s a step across hosts): a checkpoint every 10
# steps, the fault after the first; a collective gives up on a silent rank after 10 s.
FAULT_RUN = ["train.steps=60", "train.eval_every=30", "checkpoint.every=10", "parallel.timeout_s=10"]
LAYOUT = ["parallel.tensor=2"]  # TP2 inside each host x DP2 across


@pytest.fixture(scope="module")
def single_rank_fault_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("single_rank_fault_run") / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), *TRAINING, *FAULT_RUN])
    return run_dir


def is_rank(argv: list[bytes]) -> bool:
    """A training rank as torchrun starts it, `python -u -m scaletrain ...` or, warm, the client that stands
    for it, `python -u tests/warm_client.py ...` (its fork ends with it); not the agent."""
    return argv[1:4] == [b"-u", b"-m", b"scaletrain"] or argv[1:3] == [b"-u", str(WARM_CLIENT).encode()]


def assert_resumed_like_single_rank(run_dir: Path, reference: Path, output: str) -> None:
    """Resumed from the checkpoint of step 10, every step logged once, the single-rank losses (1e-4)."""
    assert f"resuming at step 10 from {run_dir / 'checkpoints' / 'step_00000010'}" in output, output[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in records if "loss" in record]
    assert steps == list(range(1, 61)), "each step once"
    ours, reference_losses = read_metrics(run_dir)[0], read_metrics(reference)[0]
    for step, record in reference_losses.items():
        assert abs(ours[step]["loss"] - record["loss"]) <= 1e-4 * record["loss"], f"step {step}"


def test_a_host_cut_off_mid_run_stops_every_rank_within_the_timeout_naming_it(
    hosts: Hosts, single_rank_fault_run: Path, small_dataset: Path, tmp_path: Path
) -> None:
    """n2's link goes down after the checkpoint of step 10. n1's ranks get no answer, give up after
    parallel.timeout_s and exit 76 with one line naming n2 and its ranks; n2's (cut off from the
    rendezvous store on n1 too) end within a bound; nothing is left running. The same command, with the
    link back, resumes from step 10 and trains the single-rank model."""
    run_dir = tmp_path / "run"
    agents = start_torchrun(hosts, "c10d", run_dir, [*LAYOUT, *FAULT_RUN], small_dataset)
    wait_for_step(run_dir, 12, agents[0].process)
    wait_for_checkpoint(run_dir, 10)
    hosts.set_link(hosts[1], up=False)
    try:
        results = finish(agents, ({76}, {1, 76}), timeout_s=120)
    finally:
        hosts.set_link(hosts[1], up=True)
    (n1_exit, n1_seconds, n1_output), (_, n2_seconds, n2_output) = results["n1"], results["n2"]
    assert n2_seconds <= 60 and ("rank 2 on n2: lost contact with" in n2_output
                                 or "lost the rendezvous store at n1:29400" in n2_output), n2_output[-3000:]
    print(f"link down -> n1's agent exited {n1_exit} after {n1_seconds:.1f} s, n2's after {n2_seconds:.1f} s "
          f"(parallel.timeout_s=10)")
    assert 10 <= n1_seconds <= 40
    # gloo's error names n2's address when TCP gives up first, else n2's ranks miss the roll call
    lost = [line for line in n1_output.splitlines() if "lost contact" in line]
    assert len(lost) == 1 and lost[0].startswith(
        "scaletrain train: error: rank 0 on n1: lost contact with n2 (10.77.0.2, ranks 2, 3)"), n1_output[-3000:]
    assert lost[0].endswith("no answer within parallel.timeout_s=10 s: the host or its link is down, or a rank "
                            "there hangs. Stopping (exit 76); a restart resumes from the last checkpoint")
    assert "scaletrain-torchrun: a rank was lost and the others stopped (exit 76" in n1_output

    resumed = finish(start_torchrun(hosts, "c10d", run_dir, [*LAYOUT, *FAULT_RUN], small_dataset), ({0}, {0}))
    assert_resumed_like_single_rank(run_dir, single_rank_fault_run, resumed["n1"][2])


def test_max_restarts_restarts_a_killed_rank_in_the_job_and_resumes_from_the_checkpoint(
    hosts: Hosts, single_rank_fault_run: Path, small_dataset: Path, tmp_path: Path
) -> None:
    """n2's ranks are SIGKILLed after the checkpoint of step 10. n1's ranks see the connection close at
    once and exit 76 naming n2; with MAX_RESTARTS=1 both agents start their ranks again (a new
    rendezvous round), which resume from step 10, and the job finishes with the single-rank losses."""
    run_dir = tmp_path / "run"
    agents = start_torchrun(hosts, "c10d", run_dir, [*LAYOUT, *FAULT_RUN], small_dataset, {"MAX_RESTARTS": "1"})
    wait_for_step(run_dir, 12, agents[0].process)
    wait_for_checkpoint(run_dir, 10)
    killed_at = time.monotonic()
    assert hosts.kill(hosts[1], is_rank), "no rank found on n2"
    results = finish(agents, ({0}, {0}))
    n1_output = results["n1"][2]
    print(f"kill -> restarted, finished {results['n1'][1]:.1f} s after the kill")
    # gloo's error names n2's address when rank 0's own connection to n2 broke first; when it was rank 1's
    # (which then exited), it names n1's, and n2's ranks are found by the roll call they miss
    lost = [line for line in n1_output.splitlines() if "lost contact" in line]
    assert len(lost) == 1 and lost[0].startswith(
        "scaletrain train: error: rank 0 on n1: lost contact with n2 (10.77.0.2, ranks 2, 3)"), n1_output[-3000:]
    assert "its connection was closed: a process there exited or was killed" in lost[0]
    assert time.monotonic() - killed_at < RUN_TIMEOUT_S
    assert_resumed_like_single_rank(run_dir, single_rank_fault_run, n1_output)


def test_hosts_and_slurm_clusters_refuse_to_start_in_a_parallel_worker(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness keeps a real cluster out of make test's parallel phase: one not marked serial fails there,
    naming the mend, before it makes a namespace or starts a daemon."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    for start in (partial(make_hosts, 2, tmp_path / "hosts"), partial(start_slurm_cluster, tmp_path / "slurm")):
        with pytest.raises(RuntimeError, match=r"in pytest-xdist worker gw1: .* mark the test module "
                                               r"`pytestmark = pytest.mark.serial`"), start():
            pass
    assert not list(tmp_path.iterdir())


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
