# Quickstart: `make demo` then `make test`. Everything runs from the local .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch goes in first and explicitly: an unpinned torch pulls a multi-GB CUDA build. Where there
# is no GPU we take the pinned (CPU) build; override TORCH_SPEC / TORCH_PIP_ARGS for other wheels,
# e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
ifeq ($(shell command -v nvidia-smi 2>/dev/null),)
TORCH_SPEC ?= torch==2.13.0
else
TORCH_SPEC ?= torch>=2.4
endif
TORCH_PIP_ARGS ?=
CORPUS := data/raw/shakespeare
ENGLISH_CORPUS := data/raw/english

.PHONY: bench-gpu install demo corpus corpus-english corpus-fineweb-edu eval-tasks test test-fast lint wheelhouse clean

# install ends by building DeepSpeed's CPU comm op (~30 s on 2 cores, once per venv) that the first run would build.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m scaletrain.train.jit_ops
	touch $@

corpus: install
	$(BIN)/python data_pipelines/shakespeare.py --out $(CORPUS)

# The ~9M-word English corpus for scaling sweeps (needs npm, and apt-get + dpkg-deb for the docs).
corpus-english: install
	$(BIN)/python data_pipelines/english.py --out $(ENGLISH_CORPUS)

# FineWeb-Edu's sample-10BT (~10B tokens, streamed from the Hugging Face Hub) for configs/gpt3_*.yaml;
# e.g. `make corpus-fineweb-edu FINEWEB_EDU_ARGS="--max-documents 100000"` for a slice.
corpus-fineweb-edu: install
	$(BIN)/python data_pipelines/web_corpora.py fineweb-edu --out data/raw/fineweb_edu $(FINEWEB_EDU_ARGS)

demo: corpus
	$(BIN)/scaletrain prepare configs/gpt_tiny.yaml
	$(BIN)/scaletrain train configs/gpt_tiny.yaml
	$(BIN)/scaletrain generate runs/gpt_tiny --prompt "ROMEO:" --max-new-tokens 80

# The data of the local lm-evaluation-harness tasks configs/eval_tasks/shakespeare_*.yaml (held-out passages,
# next-line multiple choice, cloze) from the demo dataset's val split; then, after `make demo`:
# scaletrain eval runs/gpt_tiny --tasks scaletrain_shakespeare --include-path configs/eval_tasks
eval-tasks: corpus
	$(BIN)/scaletrain prepare configs/gpt_tiny.yaml
	$(BIN)/scaletrain eval-tasks build configs/gpt_tiny.yaml --out data/eval_tasks/shakespeare

# The suite's two phases at once (tests/run_suite.py): every test not marked serial in three pytest-xdist
# workers at nice 19, and beside them the serial ones (real SLURM clusters, multi-host jobs, short
# timeouts) one at a time at normal priority, printed at the end; fails when either fails.
test: install
	$(BIN)/python -m tests.run_suite

# The edit-run loop: every test not marked slow (no multi-process layouts, kill campaigns, sweeps or
# SLURM jobs); every package is touched. At most 5 minutes on 2 cores.
test-fast: install
	$(BIN)/python -m pytest tests -n 2 --dist loadfile -m "not slow"

# The five-minute GPU check (benchmarks/gpu_check.py): throughput, peak memory, the planner's tables,
# pytest -m gpu. Needs a CUDA GPU; never part of `make test`.
bench-gpu: install
	$(BIN)/python benchmarks/gpu_check.py

lint: install
	$(BIN)/ruff check scaletrain tests data_pipelines benchmarks

# Wheels of the dependencies that compute nodes without internet lack, for their Python and platform, e.g.
# `make wheelhouse PYTHON_VERSION=3.12 HAVE=node-packages.txt` (HAVE: `python -m pip list --format=freeze` run
# on a node; PLATFORM=manylinux_2_<glibc>_<machine>, default manylinux_2_28_x86_64; WHEELHOUSE=dir, default
# wheelhouse). torch stays the image's own. It prints the install command for the nodes (README, On a cluster).
wheelhouse: install
	$(BIN)/python launch/wheelhouse.py --python-version "$(PYTHON_VERSION)" --wheelhouse "$(or $(WHEELHOUSE),wheelhouse)" \
		$(if $(PLATFORM),--platform "$(PLATFORM)") $(if $(HAVE),--have "$(HAVE)") $(WHEELHOUSE_ARGS)

clean:
	rm -rf $(VENV) runs data .cache wandb
