"""The data of the local lm-evaluation-harness tasks (configs/eval_tasks/), from a prepared dataset's held-out split.

The texts are the dataset's `val` documents, decoded from their tokens (the tokenizer round-trips text exactly):
never a document the dataset's runs train on. `scaletrain eval-tasks build CONFIG --out DIR` writes, one JSON
record a line (the task YAMLs read them with `dataset_path: json`):
  passages.jsonl   {"document", "text"}: passages of whole lines, about PASSAGE_CHARS each, for the rolling
                   log-likelihood (bits per byte, byte and word perplexity; lm-eval's wikitext task's metrics)
  next_line.jsonl  {"document", "context", "choices", "label"}: the text before a line or sentence, and that line
                   among CHOICES - 1 lines of other held-out documents (multiple choice, the shape of SWAG,
                   Zellers et al. 2018, with distractors drawn rather than generated)
  cloze.jsonl      {"document", "context", "target"}: the text up to a line's or sentence's last word, and the
                   word (LAMBADA's shape, Paperno et al. 2016: its log-likelihood, and whether it is greedy)
  tasks.json       the dataset, its split settings, the seed and the counts.
Deterministic given the dataset and the seed. A document is `document` of the split's, in index order.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import DataConfig
from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.errors import DataError
from scaletrain.data.storage import dataset_location
from scaletrain.data.tokenizer import Tokenizer

HELD_OUT_SPLIT = "val"
PASSAGE_CHARS = 500  # a rolling passage: whole lines up to at least this many characters
CONTEXT_CHARS = 300  # the context before a choice or a cloze word: from the line start this far back or before
CHOICES = 4
# A line or sentence that is a choice: words and characters. At most UNIT_CHARS keeps a choice within a small
# model's context (lm-eval refuses a continuation longer than it) and distractors comparable in length.
MIN_WORDS, MIN_CHARS, UNIT_CHARS = 3, 15, 100
MIN_CLOZE_WORDS, MIN_CLOZE_LETTERS = 4, 3
# With a single held-out document, distractors come from lines of it at least this far away.
DISTRACTOR_DISTANCE_CHARS = 5_000
# A sentence ends at . ! or ? (and any closing quotes or brackets) before whitespace.
SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)")
WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")
LAST_WORD = re.compile(r" ([A-Za-z]+)[^\w\s]*$")


@dataclass(frozen=True)
class Unit:
    """A line, or a sentence of one, at document[start:end]; what precedes it (from a line start at least
    CONTEXT_CHARS back) is its context."""

    document: int
    start: int
    end: int


def build_task_data(data: DataConfig, out_dir: Path, seed: int = 0, count: int = 100) -> dict[str, Path]:
    """Write the tasks' JSONL files and tasks.json into `out_dir` from the held-out split of `data.dir` (a
    blend's first dataset), `count` records each; returns the files by task."""
    location = dataset_location(data)
    manifest = location.load_manifest()
    documents = held_out_documents(data)
    rng = random.Random(seed)
    records = {"passages": passages(documents, rng, count), "next_line": next_lines(documents, rng, count),
               "cloze": clozes(documents, rng, count)}
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for task, task_records in records.items():
        files[task] = out_dir / f"{task}.jsonl"
        files[task].write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in task_records),
                               encoding="utf-8")
    provenance = {"dataset": location.describe(), "split": HELD_OUT_SPLIT, "documents": len(documents),
                  "tokenizer_sha256": manifest.tokenizer_sha256, "split_settings": manifest.settings, "seed": seed,
                  "records": {task: len(task_records) for task, task_records in records.items()}}
    (out_dir / "tasks.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return files


def held_out_documents(data: DataConfig) -> list[str]:
    """The text of every document of the dataset's held-out split, in index order."""
    location = dataset_location(data)
    split = PackedSequenceDataset(location, HELD_OUT_SPLIT, seq_length=1)
    tokenizer = Tokenizer.load(location.tokenizer_path())
    return [tokenizer.decode(split.document_tokens(document).tolist()) for document in range(split.num_docs)]


def passages(documents: list[str], rng: random.Random, count: int) -> list[dict]:
    """`count` passages drawn from all that the documents cut into: whole lines, starting at a non-blank one,
    up to the end of the line that reaches PASSAGE_CHARS."""
    candidates = []
    for document, text in enumerate(documents):
        start = None
        for line_start, line_end in _lines(text):
            if start is None and text[line_start:line_end].strip():
                start = line_start
            if start is not None and line_end - start >= PASSAGE_CHARS:
                candidates.append({"document": document, "text": text[start:line_end]})
                start = None
    return _drawn(candidates, rng, count, "passages")


def next_lines(documents: list[str], rng: random.Random, count: int) -> list[dict]:
    """`count` lines or sentences after their context, each among CHOICES - 1 distractors."""
    units = [unit for unit in _units(documents) if _is_choice(_text(documents, unit))]
    records = []
    for unit in _drawn([unit for unit in units if unit.start >= CONTEXT_CHARS], rng, count, "next-line items"):
        target = _text(documents, unit)
        others = sorted({_text(documents, other) for other in units if _far_apart(unit, other, len(documents))}
                        - {target})
        if len(others) < CHOICES - 1:
            raise DataError(f"the held-out split has {len(others)} lines far enough from a chosen one to be its "
                            f"distractors, fewer than {CHOICES - 1}; prepare the dataset with a larger "
                            "data.val_fraction")
        distractors = rng.sample(others, CHOICES - 1)
        label = rng.randrange(CHOICES)
        records.append({"document": unit.document, "context": _context(documents, unit),
                        "choices": [*distractors[:label], target, *distractors[label:]], "label": label})
    return records


def clozes(documents: list[str], rng: random.Random, count: int) -> list[dict]:
    """`count` contexts each ending before a line's or sentence's last word (after a space), and the word."""
    candidates = []
    for unit in _units(documents):
        text = _text(documents, unit)
        last = LAST_WORD.search(text)
        if (unit.start >= CONTEXT_CHARS and last and len(last[1]) >= MIN_CLOZE_LETTERS
                and len(WORD.findall(text)) >= MIN_CLOZE_WORDS):
            candidates.append({"document": unit.document, "target": last[1],
                               "context": _context(documents, unit, unit.start + last.start(1))})
    return _drawn(candidates, rng, count, "cloze items")


def _units(documents: list[str]) -> Iterator[Unit]:
    """Every line of every document, cut into sentences where one ends inside it."""
    for document, text in enumerate(documents):
        for line_start, line_end in _lines(text):
            start = line_start
            for end in [*(match.end() for match in SENTENCE_END.finditer(text, line_start, line_end)), line_end]:
                stripped = text[start:end].strip()
                if stripped:
                    first = text.index(stripped, start)
                    yield Unit(document, first, first + len(stripped))
                start = end


def _lines(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each line, without its newline."""
    start = 0
    for line in text.split("\n"):
        yield start, start + len(line)
        start += len(line) + 1


def _is_choice(text: str) -> bool:
    return MIN_CHARS <= len(text) <= UNIT_CHARS and len(WORD.findall(text)) >= MIN_WORDS


def _text(documents: list[str], unit: Unit) -> str:
    return documents[unit.document][unit.start:unit.end]


def _context(documents: list[str], unit: Unit, end: int | None = None) -> str:
    """The document from the start of the line CONTEXT_CHARS before the unit up to `end` (default: the unit's
    start), the whitespace before the unit included: lm-eval moves it into the continuation."""
    text = documents[unit.document]
    start = text.rfind("\n", 0, unit.start - CONTEXT_CHARS) + 1
    return text[start:unit.start if end is None else end]


def _far_apart(unit: Unit, other: Unit, num_documents: int) -> bool:
    """A distractor comes from another document, or, when the split has one, from DISTRACTOR_DISTANCE_CHARS away."""
    if num_documents > 1:
        return other.document != unit.document
    return abs(other.start - unit.start) >= DISTRACTOR_DISTANCE_CHARS


def _drawn(candidates: list, rng: random.Random, count: int, what: str) -> list:
    """`count` of the candidates drawn without replacement, in document order."""
    if len(candidates) < count:
        raise DataError(f"the held-out split has {len(candidates)} {what}, fewer than the {count} asked for; ask for "
                        f"fewer (--count), or prepare the dataset with a larger data.val_fraction")
    chosen = sorted(rng.sample(range(len(candidates)), count))
    return [candidates[index] for index in chosen]
