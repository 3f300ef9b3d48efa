"""A real SLURM cluster (slurmctld + slurmd as child processes) for tests that submit jobs: one node on
this host, or one node per namespace host of tests/hosts.py (`start_slurm_on_hosts`, issue 23).

Use the `slurm_cluster` fixture (module scope: each test module that asks for it gets its own
cluster, started in about a second). Import it into the test module under its function name:

    from tests.slurm_cluster import slurm_cluster_fixture  # noqa: F401

    def test_job(slurm_cluster, tmp_path):
        job_id = slurm_cluster.submit(["--wrap=hostname"], cwd=tmp_path)
        assert slurm_cluster.wait(job_id) == {0: "COMPLETED"}

Every cluster lives in its own directory (config, state, spool, logs, pid files) and listens on
free ports, so several can run at once and a stale daemon of a crashed run is never in the way
(nor touched). There is no munge and no accounting: AuthType=auth/none, and finished jobs are
read from `scontrol show job`, which keeps them for MinJobAge seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from tests.hosts import Host, Hosts, refuse_parallel_worker

SLURM_PROGRAMS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol")
ENABLE_HINT = "install Debian's slurm-wlm: apt-get install slurm-wlm (CI's .ci/run does this as root)"
# Job states after which a job never runs again (squeue(1), JOB STATE CODES).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                          "PREEMPTED", "BOOT_FAIL", "DEADLINE"})
SBIN_DIRECTORIES = ("/usr/local/sbin", "/usr/sbin", "/sbin")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
JOB_GRACE_S = 3.0
TIME_LIMIT_CHECK_S = 30  # PERIODIC_TIMEOUT, slurmctld/controller.c: not configurable
# What slurmctld logs at debug levels on every tick of its 1 s loop; log_tails leaves it out.
EVERY_SECOND_LOG_LINES = ("sched: Running job scheduler", "SchedulerParameters=")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class SlurmCluster:
    """A running cluster: `env` points SLURM's clients at it; `submit` and `wait` run jobs on it.
    `client` turns a client's argv into the command that runs it where the cluster is reachable (as
    host n1 for a cluster on namespace hosts; as it is for a one-node cluster on this host)."""

    directory: Path
    conf: Path
    nodes: list[str]
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)
    client: Callable[[Sequence[str]], list[str]] = list

    @property
    def node(self) -> str:
        return self.nodes[0]

    def run(self, command: list[str], timeout: float = 30.0) -> str:
        """Run a SLURM client against this cluster; fail with its stderr and the daemons' logs."""
        result = subprocess.run(self.client(command), env=self.env, capture_output=True, text=True,
                                timeout=timeout)
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}\n"
                                 f"{self.log_tails()}")
        return result.stdout

    def submit(self, args: list[str], cwd: Path | str, env: dict[str, str] | None = None) -> int:
        """`sbatch --parsable ARGS` run in `cwd`; returns the job id (of the whole array, for arrays).
        `env` adds to the environment sbatch exports to the job."""
        result = subprocess.run(self.client(["sbatch", "--parsable", *args]), cwd=cwd,
                                env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job_records(self, job_id: int) -> list[tuple[str, str]]:
        """(ArrayTaskId, JobState) of each record scontrol keeps for the job: one per array task that has
        left the queue, one for the range of tasks still pending ("1-2%1"); a plain job is task "0"."""
        records = []
        for line in self.run(["scontrol", "--oneliner", "show", "job", str(job_id)]).splitlines():
            state = re.search(r"\bJobState=(\S+)", line)
            task = re.search(r"\bArrayTaskId=(\S+)", line)
            if state is not None:
                records.append((task.group(1) if task else "0", state.group(1)))
        return records

    def job_fields(self, job_id: int) -> dict[str, str]:
        """The KEY=VALUE fields `scontrol show job` gives for a plain job (JobState, ExitCode, Restarts, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.run(["scontrol", "--oneliner", "show", "job", str(job_id)])))

    def next_time_limit_check(self) -> float:
        """The earliest time (epoch seconds) at which slurmctld next looks at the running jobs' time
        limits, which is when it sends a job's --signal. Its 1 s background loop looks once 30 whole
        seconds have passed since the last look (PERIODIC_TIMEOUT, slurmctld/controller.c), so at the
        first tick of that second or, rarely, the next; the first look counts from the loop's start, just
        after "Running as primary controller". Each look is logged (SlurmctldDebug=debug2, write_conf)."""
        log = (self.directory / "slurmctld.log").read_text(errors="replace")
        looks = re.findall(r"^\[([\d\-T:.]+)\] debug2: Testing job time limits", log, flags=re.MULTILINE)
        if not looks:
            looks = re.findall(r"^\[([\d\-T:.]+)\] Running as primary controller", log, flags=re.MULTILINE)
        if not looks:
            raise AssertionError(f"slurmctld has not logged its start\n{self.log_tails()}")
        return math.floor(datetime.fromisoformat(looks[-1]).timestamp()) + TIME_LIMIT_CHECK_S

    def wait(self, job_id: int, timeout: float = 60.0) -> dict[int, str]:
        """Poll until no task of the job (array tasks included) can still run; final JobState by task id."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_daemons()
            records = self.job_records(job_id)
            if records and all(state in FINAL_STATES for _, state in records):
                return {int(task): state for task, state in records}  # a pending range is never final
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} unfinished after {timeout:.0f} s: {records}\n{self.log_tails()}")
            time.sleep(0.25)

    def check_daemons(self) -> None:
        """Fail, with their logs, if slurmctld or a slurmd has exited."""
        exited = {name: daemon.returncode for name, daemon in self.daemons.items() if daemon.poll() is not None}
        if exited:
            raise AssertionError(f"SLURM daemons exited (exit codes {exited})\n{self.log_tails()}")

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of each daemon's log file and of its own stdout/stderr."""
        tails = []
        for log in sorted(self.directory.glob("*.log")):
            events = [line for line in log.read_text(errors="replace").splitlines()
                      if not any(noise in line for noise in EVERY_SECOND_LOG_LINES)]
            tail = events[-lines:]
            tails.append(f"--- {log} ---\n" + "\n".join(tail))
        return "\n".join(tails)


def find_program(name: str) -> str | None:
    """Path of a SLURM program; the daemons live in sbin, which a non-root PATH often lacks."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN_DIRECTORIES]))


def missing_requirement() -> str | None:
    """Why no cluster can start here (a skip reason), or None."""
    reasons = []
    missing = [program for program in SLURM_PROGRAMS if find_program(program) is None]
    if missing:
        reasons.append(f"SLURM programs not found: {', '.join(missing)}; {ENABLE_HINT}")
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        reasons.append("slurmd must run as root to start jobs here; run the tests as root (CI does)")
    return "; ".join(reasons) or None


def free_ports(count: int) -> list[int]:
    """Ports the kernel has just handed out as free, all distinct (sockets held open together)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def write_conf(directory: Path, nodes: Sequence[tuple[str, str]], ports: tuple[int, int]) -> Path:
    """slurm.conf of a cluster whose every file lives in `directory`: `nodes` are (name, address), the
    first also runs the controller; ports are the controller's and the nodes'. With several nodes each
    slurmd has its own spool, pid and log file (%n: the node's name)."""
    (directory / "state").mkdir(parents=True)
    several = len(nodes) > 1
    spools = [directory / (f"spool_{name}" if several else "spool") for name, _ in nodes]
    for spool in spools:
        spool.mkdir()
    per_node = "_%n" if several else ""
    memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    (controller, controller_address), controller_port, node_port = nodes[0], *ports
    settings = {
        "ClusterName": "scaletraintest",
        # Name and address given together: the controller needs no DNS entry for this host.
        "SlurmctldHost": f"{controller}({controller_address})",
        "SlurmctldPort": controller_port,
        "SlurmdPort": node_port,
        # No munge daemon: both authentication and job credentials are plugins that do nothing.
        "AuthType": "auth/none",
        "CredType": "cred/none",
        # A requeued job waits cred_expire + 1 s before it may start again (slurmctld/job_mgr.c,
        # _job_requeue_op), 121 s by default; 5 s is the least slurm_cred.c accepts, and a step's launch
        # credential is checked by slurmd within a second of slurmctld making it.
        "AuthInfo": "cred_expire=5",
        # No cgroups or systemd in containers: track job processes by parent pid, bind nothing.
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "MpiDefault": "none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_Core",
        # Start a batch job within the controller's 1 s tick of its submission, not up to 3 s later, and a
        # requeued one within a second of its begin time, not at the next main (60 s) or backfill (30 s) pass.
        "SchedulerParameters": "batch_sched_delay=0,sched_interval=1",
        # Trust the node line below, not the hardware slurmd detects, so a mismatch never drains it.
        "SlurmdParameters": "config_overrides",
        "ReturnToService": 2,
        # Without accounting storage, finished jobs are only known to slurmctld, for MinJobAge seconds.
        "MinJobAge": 3600,
        "JobCompType": "jobcomp/none",
        "AccountingStorageType": "accounting_storage/none",
        "StateSaveLocation": directory / "state",
        "SlurmdSpoolDir": directory / f"spool{per_node}",
        "SlurmctldPidFile": directory / "slurmctld.pid",
        "SlurmdPidFile": directory / f"slurmd{per_node}.pid",
        "SlurmctldLogFile": directory / "slurmctld.log",
        # debug2 logs each of the controller's time-limit checks (SlurmCluster.next_time_limit_check).
        "SlurmctldDebug": "debug2",
        "SlurmdLogFile": directory / f"slurmd{per_node}.log",
    }
    if several:
        # A node that stops answering is DOWN after 10 s, not 300: the job on it ends NODE_FAIL and,
        # with --requeue, starts again on the other nodes (slurm.conf(5) SlurmdTimeout). The controller
        # sees it after two pings have failed, each waiting MessageTimeout: 5 s, not 10 (about 18 s, not 24).
        settings["SlurmdTimeout"] = 10
        settings["MessageTimeout"] = 5
    lines = [f"{key}={value}" for key, value in settings.items()]
    lines += [f"NodeName={name} NodeAddr={address} CPUs={os.cpu_count()} "
              f"RealMemory={max(memory_mib // (2 * len(nodes)), 1)} State=UNKNOWN" for name, address in nodes]
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    conf = directory / "slurm.conf"
    conf.write_text("".join(f"{line}\n" for line in lines))
    return conf


@contextlib.contextmanager
def start_slurm_cluster(directory: Path) -> Iterator[SlurmCluster]:
    """Start slurmctld and slurmd on this host with a fresh config in `directory`; on exit, stop
    everything they started."""
    refuse_parallel_worker("a SLURM cluster started")
    node = socket.gethostname().split(".")[0]  # slurmd names itself by the short host name
    conf = write_conf(directory, [(node, "127.0.0.1")], tuple(free_ports(2)))
    cluster = SlurmCluster(directory, conf, [node], {**os.environ, "SLURM_CONF": str(conf)})
    try:
        for daemon in ("slurmctld", "slurmd"):
            cluster.daemons[daemon] = _start_daemon(cluster, daemon, [str(find_program(daemon)), "-D", "-f", str(conf)],
                                                    subprocess.Popen)
        wait_until_idle(cluster)
        yield cluster
    finally:
        stop(cluster)


@contextlib.contextmanager
def start_slurm_on_hosts(hosts: Hosts, directory: Path) -> Iterator[SlurmCluster]:
    """A cluster of one node per host: slurmctld on the first host, `slurmd -N NAME` on each, the clients
    run as the first host (the only way to reach the controller, and test traffic stays inside the
    hosts' namespaces). Jobs start in their node's namespace, with its name and address."""
    conf = write_conf(directory, [(host.name, host.address) for host in hosts.hosts], (6817, 6818))
    first = hosts[0]
    cluster = SlurmCluster(directory, conf, [host.name for host in hosts.hosts],
                           {**os.environ, "SLURM_CONF": str(conf)}, client=lambda argv: hosts.command(first, argv))
    try:
        daemons: list[tuple[Host, str, list[str]]] = [(first, "slurmctld", [])]
        daemons += [(host, f"slurmd-{host.name}", ["-N", host.name]) for host in hosts.hosts]
        for host, name, extra in daemons:
            program = str(find_program(name.split("-")[0]))
            cluster.daemons[name] = _start_daemon(
                cluster, name, [program, "-D", "-f", str(conf), *extra],
                lambda command, host=host, **kwargs: hosts.popen(host, command, **kwargs))
        wait_until_idle(cluster)
        yield cluster
    finally:
        stop(cluster)


def _start_daemon(cluster: SlurmCluster, name: str, command: list[str], popen: Callable[..., subprocess.Popen]
                  ) -> subprocess.Popen:
    """Start a daemon in the foreground (-D), its console output in NAME-console.log."""
    with open(cluster.directory / f"{name}-console.log", "w") as console:
        return popen(command, env=cluster.env, stdout=console, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)


def die_with_parent() -> None:
    """Run in a daemon before exec: the kernel sends it SIGTERM if the test process dies without
    stopping it (prctl(2), PR_SET_PDEATHSIG), so a crashed run leaves no daemon behind."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_until_idle(cluster: SlurmCluster, timeout: float = START_TIMEOUT_S) -> None:
    """Return once the controller reports every node idle; fail early if a daemon exits."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        cluster.check_daemons()
        result = subprocess.run(cluster.client(["scontrol", "--oneliner", "show", "node"]), env=cluster.env,
                                capture_output=True, text=True, timeout=30)
        states = dict(re.findall(r"\bNodeName=(\S+) .*?\bState=(\S+)", result.stdout))
        if sorted(states) == sorted(cluster.nodes) and set(states.values()) == {"IDLE"}:
            return
        time.sleep(0.1)
    raise AssertionError(f"nodes not idle {timeout:.0f} s after starting the SLURM daemons "
                         f"(states {states or 'not reported'})\n{cluster.log_tails()}")


def stop(cluster: SlurmCluster) -> None:
    """Stop the daemons (no job starts after that), then every job process they left behind."""
    for daemon in cluster.daemons.values():
        daemon.terminate()
    for daemon in cluster.daemons.values():
        try:
            daemon.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    end_job_processes(f"SLURM_CONF={cluster.conf}".encode())


def end_job_processes(marker: bytes) -> None:
    """SIGTERM, then SIGKILL after a grace period, every process whose environment holds `marker`.

    Job processes and their slurmstepd are not our children: sbatch exports this cluster's SLURM_CONF
    into every job, and no other cluster shares it. A slurmstepd ignores SIGTERM (it keeps retrying to
    report to the slurmd that is gone), so it gets SIGKILL at once; it holds nothing worth saving.
    """
    deadline = time.monotonic() + JOB_GRACE_S
    signalled: set[int] = set()
    while leftovers := processes_with_environment(marker):
        if time.monotonic() > deadline + STOP_TIMEOUT_S:
            raise AssertionError(f"job processes survived SIGKILL: {leftovers}")
        for pid, name in leftovers.items():
            if name == "slurmstepd" or time.monotonic() > deadline:
                signal_number = signal.SIGKILL
            elif pid not in signalled:
                signal_number = signal.SIGTERM
            else:
                continue
            signalled.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal_number)
        time.sleep(0.1)


def processes_with_environment(entry: bytes) -> dict[int, str]:
    """Name by pid of the live processes (other than this one) whose environment holds `entry` (NAME=value)."""
    processes = {}
    for process in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if entry in (process / "environ").read_bytes().split(b"\0") and int(process.name) != os.getpid():
                processes[int(process.name)] = (process / "comm").read_text().strip()
    return processes


@pytest.fixture(scope="module", name="slurm_cluster")
def slurm_cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running one-node cluster for the whole test module; skipped where SLURM or root is missing."""
    reason = missing_requirement()
    if reason is not None:
        pytest.skip(reason)
    with start_slurm_cluster(tmp_path_factory.mktemp("slurm_cluster")) as cluster:
        yield cluster
