#!/usr/bin/env bash
# Single-node launch: launch/torchrun.sh NUM_PROCESSES CONFIG [key=value ...]
#   launch/torchrun.sh 4 configs/gpt_tiny.yaml parallel.tensor=2 parallel.zero_stage=1
# scaletrain-torchrun is torchrun that passes SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 to the ranks, which
# checkpoint at the next step, and exits 75 when they stopped early: run the same command to resume.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 NUM_PROCESSES CONFIG [key=value ...]" >&2
  exit 2
fi
nproc=$1; shift
exec scaletrain-torchrun --standalone --nproc_per_node="$nproc" -m scaletrain train "$@"
