#!/usr/bin/env bash
# One node:  launch/torchrun.sh NUM_PROCESSES CONFIG [key=value ...]
#   launch/torchrun.sh 4 configs/gpt_tiny.yaml parallel.tensor=2 parallel.zero_stage=1
# Several nodes: the same command on every node, with NNODES and RDZV_ENDPOINT (HOST:PORT on any one of
# them, the same for all) set; torchrun's c10d rendezvous gathers the nodes, RDZV_ID (default
# scaletrain) names the job. NUM_PROCESSES is per node; ranks are numbered node by node, and with
# TP fastest a TP group of at most NUM_PROCESSES ranks stays inside a node:
#   NNODES=2 RDZV_ENDPOINT=node1:29400 launch/torchrun.sh 2 configs/gpt_tiny.yaml parallel.tensor=2
# scaletrain-torchrun is torchrun that passes SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 to the ranks, which
# checkpoint at the next step, and exits 75 when they stopped early: run the same command to resume.
# A rank lost mid-run (its process killed, its node gone) stops the others within parallel.timeout_s
# with one line naming it, exit 76; MAX_RESTARTS=N (torchrun's --max-restarts) restarts the ranks of
# every node up to N times in the same job instead, each start resuming from the last checkpoint.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: [NNODES=N RDZV_ENDPOINT=HOST:PORT [RDZV_ID=NAME]] [MAX_RESTARTS=N] $0 NUM_PROCESSES CONFIG [key=value ...]" >&2
  exit 2
fi
nproc=$1; shift
if [[ -n "${NNODES:-}" && "$NNODES" != 1 ]]; then
  if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
    echo "$0: NNODES=$NNODES needs RDZV_ENDPOINT=HOST:PORT, a node every node can reach (e.g. the first)" >&2
    exit 2
  fi
  meeting=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="${RDZV_ID:-scaletrain}")
else
  meeting=(--standalone)
fi
exec scaletrain-torchrun "${meeting[@]}" --max-restarts="${MAX_RESTARTS:-0}" --nproc_per_node="$nproc" \
  -m scaletrain train "$@"
