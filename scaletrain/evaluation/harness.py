"""scaletrain's model as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`), and a run of tasks on it.

Only `scaletrain eval --tasks` (evaluation/downstream.py) and code that evaluates in the loop import this module:
lm-eval is an optional extra (`pip install 'scaletrain[eval]'`).

The numbers are those of lm-eval's own `hf` backend on the run's export (`scaletrain export`) run with
`hf_model_args`: the same tokenization (the run's sentencepiece model, as the export's tokenizer encodes it),
the same requests (lm-eval's TemplateLM pairs and rolling windows) and the same scoring rules (scoring.py):
  - a decoder-only LM's text is encoded bare, and a text without context follows an eos, the separator its
    training documents followed (the hf backend: add_bos_token=False, prefix_token_id=eos; its default would put
    the untrained bos first);
  - an encoder-decoder's context ends with the eos its encoder inputs ended with (the export's tokenizer adds it)
    and the continuation is bare; an empty context is the eos alone.
generate_until writes what `scaletrain generate` writes at temperature 0 (the KV cache; past the context it
slides the window), cut at the first stop sequence.

Requests are shared among the data-parallel ranks (lm-eval's rank and world size are the data-parallel ones);
the ranks of a tensor-parallel group score the same ones together.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lm_eval import simple_evaluate, utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

from scaletrain.evaluation.scoring import Scorer

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf backend's, for a task that names none


class ScaletrainLM(TemplateLM):
    """lm-eval's model API over a Scorer. `data_parallel_group` (megatron's data-parallel group) shares the
    requests among its ranks, every rank of a tensor-parallel group scoring the same; None: this process scores
    every request (with TP, so does each rank of the group)."""

    def __init__(self, scorer: Scorer, data_parallel_group: Any = None, model_info: dict | None = None) -> None:
        super().__init__()
        self.scorer = scorer
        self.backend = "seq2seq" if scorer.encoder_decoder else "causal"
        self.data_parallel_group = data_parallel_group
        if data_parallel_group is not None:
            self._rank = dist.get_rank(data_parallel_group)
            self._world_size = dist.get_world_size(data_parallel_group)
        self._device = scorer.device
        self.model_info = model_info or {}

    @property
    def eot_token_id(self) -> int:
        return self.scorer.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self.scorer.context_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """As the export's tokenizer under the hf backend: special tokens (the family's framing) by default for an
        encoder-decoder, not for a decoder-only LM (add_bos_token=False)."""
        ids = self.scorer.tokenizer.encode(string)
        framed = self.backend == "seq2seq" if add_special_tokens is None else add_special_tokens
        return self.scorer.generation.frame(self.scorer.tokenizer, ids) if framed else ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.scorer.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) strings or None, context ids, continuation ids)."""
        results = self.scorer.loglikelihoods([(context, continuation) for _, context, continuation in requests])
        for (strings, _, _), result in zip(requests, results, strict=True):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood after the prefix token, in windows of the context length where each
        token is predicted once with as much context as fits (lm-eval's rolling windows, context_len=1)."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (text,) in (request.args for request in requests):
            rolling = utils.get_rolling_token_windows(self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                      max_seq_len=self.max_length, context_len=1)
            text_windows = [(None, *utils.make_disjoint_window(window)) for window in rolling]
            windows += text_windows
            counts.append(len(text_windows))
        scores = iter(self._loglikelihood_tokens(windows))
        totals = [sum(next(scores)[0] for _ in range(count)) for count in counts]
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context continued as `scaletrain generate` continues it (greedy unless the task samples), up to
        max_gen_toks tokens, cut before the first stop sequence."""
        eos = self.tok_decode([self.eot_token_id])
        texts = []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            temperature = kwargs["temperature"] if kwargs["do_sample"] else 0.0
            text = self.scorer.continue_text(context, kwargs["max_gen_toks"], temperature, kwargs.get("top_k"))
            texts.append(postprocess_generated_text(text, until, think_end_token=None))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), texts[-1])
        return texts

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        shards = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(shards, tensor.contiguous(), group=self.data_parallel_group)
        return torch.stack(shards) if tensor.dim() == 0 else torch.cat(shards)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, group=self.data_parallel_group, group_dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.data_parallel_group)

    def get_model_info(self) -> dict:
        """What lm-eval records under the results' "config": the checkpoint, its layout and the hf backend's
        matching model_args."""
        return self.model_info


def hf_model_args(export_dir: Path | str, encoder_decoder: bool, context_length: int, eos_id: int) -> str:
    """lm-eval's `--model hf --model_args` that scores the run's export as ScaletrainLM scores the run.

    logits_cache=False: with its default the hf backend scores a one-token continuation with the logits of
    another request whose context + continuation less its last token has the same ids, even when that request was
    cut from the left to fit the context and this one was not (0.4.13, `_loglikelihood_tokens`'s
    group_by="contexts"): a next-line choice and the cloze item on the same line did so (1.13 nats apart)."""
    bare = "" if encoder_decoder else ",add_bos_token=False"
    return f"pretrained={export_dir}{bare},prefix_token_id={eos_id},max_length={context_length},logits_cache=False"


@dataclass(frozen=True)
class TaskSelection:
    """The tasks to run (names, or the configs of task YAML files) and the TaskManager that knows them all."""

    manager: TaskManager
    tasks: list[str | dict]


def run_tasks(lm: ScaletrainLM, selection: TaskSelection, limit: float | None = None, num_fewshot: int | None = None,
              bootstrap_iters: int = 100_000, log_samples: bool = False) -> dict | None:
    """lm-eval's results of the selected tasks on `lm`: the dict its CLI writes (with each document's requests
    and responses under "samples" if `log_samples`), on the first data-parallel rank of tensor rank 0 (None
    elsewhere). The random state lm-eval reseeds (random, numpy, torch) is put back after."""
    with _kept_random_state():
        return simple_evaluate(model=lm, tasks=selection.tasks, task_manager=selection.manager,
                               num_fewshot=num_fewshot, limit=limit, bootstrap_iters=bootstrap_iters,
                               log_samples=log_samples)


def select_tasks(tasks: Sequence[str], include_paths: Sequence[Path] = ()) -> TaskSelection:
    """`tasks` (names, task YAML files or directories of them; `include_paths`: directories of local tasks that
    names refer to), each found, or one error naming those that are not: a directory is added to the include
    paths and stands for the tasks defined in it. lm-eval's own tasks are indexed (~6 s) only when a name is not
    found among the local ones."""
    paths, selected = [Path(path) for path in include_paths], []
    for entry in tasks:
        path = Path(entry)
        if path.is_dir():
            paths.append(path)
            defined = TaskManager(include_path=str(path), include_defaults=False).all_subtasks
            if not defined:
                raise ValueError(f"--tasks {entry}: the directory defines no task (a YAML file with a `task:` key)")
            selected += defined
        elif path.suffix in (".yaml", ".yml") and path.is_file():
            config = load_yaml(path, resolve_func=True)
            _check_data_files(path, config)
            selected.append(config)
        else:
            selected.append(entry)
    names = [entry for entry in selected if isinstance(entry, str)]
    include_path = [str(path) for path in paths] or None
    manager = TaskManager(include_path=include_path, include_defaults=False) if paths else None
    if manager is None or not all(manager.match_tasks([name]) for name in names):
        manager = TaskManager(include_path=include_path)
    missing = [name for name in names if not manager.match_tasks([name])]
    if missing:
        where = f" or under {', '.join(map(str, paths))}" if paths else ""
        raise ValueError(f"--tasks: no task {', '.join(missing)} in lm-evaluation-harness{where}; give task names "
                         "(`lm-eval ls tasks`), task YAML files or directories of them, and --include-path DIR for "
                         "the directories of local tasks that names refer to")
    for name in names:
        _check_named_data_files(manager, name)
    return TaskSelection(manager, selected)


def output_types(selection: TaskSelection) -> dict[str, str]:
    """Each selected task's lm-eval output_type (loglikelihood, multiple_choice, loglikelihood_rolling or
    generate_until) by task name, a group's or tag's member tasks each: what the model will be asked to do. The
    tasks are built, their data loaded, as simple_evaluate builds them."""
    return {name: task.config.output_type for name, task in selection.manager.load(selection.tasks)["tasks"].items()}


def _check_named_data_files(manager: TaskManager, name: str) -> None:
    """_check_data_files for a task named (by its name, a tag or a group of its YAML): each member task's YAML."""
    entry = manager.task_index.get(name)
    if entry is None:
        return
    if entry.yaml_path is not None and isinstance(entry.cfg, dict):
        _check_data_files(Path(entry.yaml_path), entry.cfg)
    elif entry.tags and entry.yaml_path is None:  # a tag: `tags` holds its member tasks
        for member in sorted(entry.tags):
            if member != name:
                _check_named_data_files(manager, member)


def _check_data_files(task_file: Path, config: Any) -> None:
    """A local task's `dataset_kwargs.data_files` exist (relative to the working directory, where lm-eval reads
    them), or one error naming the file: found now rather than when the task is first scored, which in the loop
    is after training."""
    data_files = (config.get("dataset_kwargs") or {}).get("data_files") if isinstance(config, dict) else None
    if data_files is None:
        return
    listed = data_files.values() if isinstance(data_files, dict) else [data_files]
    for files in listed:
        for file in [files] if isinstance(files, str) else files:
            if "://" not in file and not any(character in file for character in "*?[") and not Path(file).is_file():
                raise ValueError(f"--tasks {task_file}: its data file {file} does not exist (relative to {Path.cwd()}, "
                                 "where lm-eval reads it); build it with `scaletrain eval-tasks build CONFIG --out "
                                 "DIR` (the YAML's comment names CONFIG and DIR), or run from the directory it is "
                                 "relative to")


@contextlib.contextmanager
def _kept_random_state() -> Iterator[None]:
    """simple_evaluate seeds random, numpy and torch for its fewshot sampling: a training loop that evaluates
    in place keeps its own streams."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
