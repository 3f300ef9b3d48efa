"""The files of a sweep directory, in one place:

    SWEEP/sweep.json           the spec (base config resolved) and the working directory it ran from
    SWEEP/plan.json            every planned run: shape, N, D, C, steps, LR, warmup, predicted time
    SWEEP/results.csv          one row per run (results.py), rewritten by `sweep run|status|finalize`
    SWEEP/fit/                 fit.json and the plots (scaletrain fit)
    SWEEP/slurm/               job-array scripts and SLURM logs
    SWEEP/wandb/               the W&B summary run
    SWEEP/runs/NAME/run.yaml   the run's full config; the run directory as `scaletrain train` writes it
    SWEEP/runs/NAME/status.json, train.log   how the executor ran it
"""

SWEEP_FILE = "sweep.json"
PLAN_FILE = "plan.json"
RESULTS_FILE = "results.csv"
FIT_DIR = "fit"
RUNS_DIR = "runs"
RUN_CONFIG_FILE = "run.yaml"
STATUS_FILE = "status.json"
TRAIN_LOG = "train.log"
