"""What crossing hosts costs: gloo all-reduce bandwidth and a DP2 training step, two ranks on one host
against one rank on each of two hosts (issue 23). Run as root (it makes network namespaces):

    .venv/bin/python benchmarks/cross_host.py                      # all-reduce only
    .venv/bin/python benchmarks/cross_host.py --data data/shakespeare_8k   # and the DP2 step (make demo)

The hosts are the test suite's (tests/hosts.py): network namespaces on this machine joined by a bridge,
each with its own name and address. Between two of them a message crosses two veth pairs and a bridge in
the kernel; between two ranks of one host it crosses loopback. So this measures what the launch path
costs once ranks are on different hosts (addresses, rendezvous, gloo's TCP pairs over a real
interface), not a datacenter network: on a cluster, NCCL over InfiniBand or RoCE is another story, and
the figure to compare against is the fabric's own (nccl-tests' busbw).

Bus bandwidth as nccl-tests defines it for all-reduce: busbw = size / time x 2 (n - 1) / n, which for
n = 2 is the algorithm bandwidth (each rank sends and receives `size`). Each size is all-reduced
`--iterations` times after 3 warm-up calls; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.hosts import Hosts, make_hosts, missing_requirement  # noqa: E402

SIZES_MB = (1, 8, 64)
PORT = 29600


def all_reduce_worker(sizes_mb: list[int], iterations: int) -> None:
    """Under torchrun: time gloo all-reduces of each size; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = {}
    for size_mb in sizes_mb:
        tensor = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
        for _ in range(3):
            dist.all_reduce(tensor)
        times = []
        for _ in range(iterations):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        results[size_mb] = {"median_ms": median * 1e3,
                            "busbw_gb_s": size_mb * 2**20 / median * 2 * (world - 1) / world / 1e9}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def torchrun(hosts: Hosts, placement: str, module_args: list[str], environment: dict[str, str]) -> str:
    """Two ranks, both on n1 ("one host") or one on n1 and one on n2 ("two hosts"); rank 0's output."""
    python = [sys.executable, "-m", "torch.distributed.run", f"--master_addr={hosts[0].name}",
              f"--master_port={PORT}"]
    if placement == "one host":
        commands = [(hosts[0], [*python, "--nnodes=1", "--nproc_per_node=2", *module_args])]
    else:
        commands = [(host, [*python, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={index}", *module_args])
                    for index, host in enumerate(hosts.hosts[:2])]
    processes = [hosts.popen(host, command, cwd=REPO, env=environment, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for host, command in commands]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    for process, output in zip(processes, outputs, strict=True):
        if process.returncode != 0:
            raise SystemExit(f"{placement}: a rank failed (exit {process.returncode}):\n{output[-3000:]}")
    return outputs[0]


def step_times(run_dir: Path, skip: int) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["step_time_s"] for record in records if "step_time_s" in record][skip:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=list(SIZES_MB))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--data", type=Path, help="a prepared dataset for the DP2 step (configs/gpt_tiny.yaml's)")
    parser.add_argument("--steps", type=int, default=40, help="DP2 steps per placement (the first 10 not timed)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        all_reduce_worker(args.sizes_mb, args.iterations)
        return
    reason = missing_requirement()
    if reason is not None:
        raise SystemExit(f"cross_host.py: {reason}")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    rows = []
    with tempfile.TemporaryDirectory() as scratch, make_hosts(2, Path(scratch) / "hosts") as hosts:
        for placement in ("one host", "two hosts"):
            output = torchrun(hosts, placement, [str(Path(__file__).resolve()), "--worker", "--iterations",
                                                 str(args.iterations), "--sizes-mb", *map(str, args.sizes_mb)],
                              environment)
            result = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])
            for size_mb, figures in result.items():
                rows.append((placement, f"all-reduce {size_mb} MB", f"{figures['median_ms']:.2f} ms",
                             f"{figures['busbw_gb_s']:.2f} GB/s"))
            if args.data is not None:
                run_dir = Path(scratch) / placement.replace(" ", "_")
                torchrun(hosts, placement, ["-m", "scaletrain", "train", str(REPO / "configs" / "gpt_tiny.yaml"),
                                            f"data.dir={args.data.resolve()}", f"run.dir={run_dir}",
                                            f"train.steps={args.steps}", f"train.eval_every={args.steps}",
                                            f"checkpoint.every={args.steps}", "tracking.wandb=disabled"],
                         environment)
                times = step_times(run_dir, skip=10)
                rows.append((placement, "gpt_tiny DP2 ZeRO-1 step", f"{statistics.median(times) * 1e3:.1f} ms",
                             f"{len(times)} steps"))
    print(f"{'placement':<10}  {'what':<26}  {'median':>10}  {'':>12}")
    for row in rows:
        print(f"{row[0]:<10}  {row[1]:<26}  {row[2]:>10}  {row[3]:>12}")


if __name__ == "__main__":
    main()
