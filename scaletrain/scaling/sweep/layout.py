"""The files of a sweep directory, in one place:

    SWEEP/sweep.json           the spec (base config resolved) and the working directory it ran from
    SWEEP/plan.json            every planned run: shape, N, D, C, steps, LR, warmup, predicted time
    SWEEP/results.csv          one row per run (results.py), rewritten by `sweep run|status|finalize`
    SWEEP/fit/                 fit.json and the plots (scaletrain fit)
    SWEEP/slurm/               job-array scripts and SLURM logs
    SWEEP/wandb/               the W&B summary run
    SWEEP/runs/NAME/run.yaml   the run's full config; the run directory as `scaletrain train` writes it
    SWEEP/runs/NAME/status.json, train.log   how the executor ran it
    SWEEP/tune/                `sweep tune`: its grid as a sweep of its own, tuned.json, check.json

and the columns of results.csv, which the spec's fit exclusions name (spec.py) without loading the
training code that results.py needs. Beyond RESULT_COLUMNS, results.csv has one column per downstream task
metric that its runs recorded (DOWNSTREAM_PREFIX + TASK/METRIC, e.g. downstream/english_next_line/acc), only
when some run recorded one: the in-loop evaluation's `eval/downstream/TASK/METRIC` (METRIC_PREFIX) of the
run's final step, which the ladder's downstream prediction fits (scaling/downstream.py).
"""

SWEEP_FILE = "sweep.json"
PLAN_FILE = "plan.json"
RESULTS_FILE = "results.csv"
FIT_DIR = "fit"
RUNS_DIR = "runs"
RUN_CONFIG_FILE = "run.yaml"
STATUS_FILE = "status.json"
TRAIN_LOG = "train.log"

# params and non_embedding_params are the totals; active_params and active_non_embedding_params what a
# token meets (a mixture of experts' routed experts only; a dense model's equal the totals). Results
# written before the active columns existed lack them: readers take the totals (fit_inputs.py).
RESULT_COLUMNS = (
    "name", "status", "budget", "seed", "num_layers", "hidden_size", "num_heads", "params", "non_embedding_params",
    "active_params", "active_non_embedding_params", "tokens", "flops", "flops_per_token", "lr", "val_loss",
    "train_loss", "steps", "wall_s", "data_fingerprint", "role",
)

# A run's downstream metric as train/ logs it (metrics.jsonl, summary.json), and as results.csv names it.
METRIC_PREFIX = "eval/downstream/"
DOWNSTREAM_PREFIX = "downstream/"
