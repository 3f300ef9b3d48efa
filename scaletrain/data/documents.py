"""Raw inputs -> named documents (one .txt file, or one .jsonl line, each) and their train/val split."""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from scaletrain.data.errors import DataError

SUFFIXES = (".txt", ".jsonl")


@dataclass(frozen=True)
class Document:
    """Where a document's text is. `name` is stable across runs and decides the split.

    `num_bytes` is its size on disk (the .txt file, or the .jsonl line with its JSON escapes), known
    without reading the text, so a byte budget (the tokenizer's training sample) can be planned up front.
    """

    name: str
    path: Path
    line: int | None = None  # 0-based line of a .jsonl file; None for a whole .txt file
    num_bytes: int = 0


def resolve_raw_paths(raw_paths: Sequence[Path | str]) -> list[Path]:
    """Files named by `raw_paths` (files, directories searched recursively, or glob patterns), sorted."""
    files: set[Path] = set()
    for raw in raw_paths:
        path = Path(raw)
        if path.is_dir():
            files.update(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise DataError(f"raw input {path} is neither .txt nor .jsonl; convert it or leave it out")
            files.add(path)
        else:
            files.update(Path(p) for p in glob.glob(str(raw), recursive=True) if Path(p).suffix in SUFFIXES)
    if not files:
        raise DataError(
            f"raw paths {[str(p) for p in raw_paths]} match no .txt or .jsonl files; "
            "check the paths (build the corpus first, e.g. `python data_pipelines/shakespeare.py --out DIR`)"
        )
    return sorted(path.resolve() for path in files)


def list_documents(files: Sequence[Path]) -> list[Document]:
    """One Document per .txt file and per non-blank .jsonl line, in file order.

    Names are file names, plus the line for .jsonl (`hamlet_gut.txt`,
    `part1.jsonl:17`): a document keeps its split when the corpus grows or
    moves. Two files of one name in different folders merely share hashes.
    """
    documents: list[Document] = []
    for path in files:
        name = path.name
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as lines:
                documents.extend(Document(f"{name}:{n}", path, n, len(line.encode()))
                                 for n, line in enumerate(lines) if line.strip())
        else:
            documents.append(Document(name, path, num_bytes=path.stat().st_size))
    return documents


def iter_texts(documents: Sequence[Document]) -> Iterator[str]:
    """The documents' texts in order, streaming each .jsonl file once."""
    for path, group in groupby(documents, key=lambda doc: doc.path):
        docs = list(group)
        if docs[0].line is None:
            for _ in docs:
                yield _read_utf8(path)
            continue
        wanted = {doc.line: doc for doc in docs}
        with path.open(encoding="utf-8") as lines:
            for n, line in enumerate(lines):
                if n in wanted:
                    yield _jsonl_text(wanted[n], line)


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 ({error}); re-encode it, e.g. `iconv -t utf-8`") from error


def _jsonl_text(doc: Document, line: str) -> str:
    try:
        text = json.loads(line)["text"]
    except (ValueError, KeyError, TypeError) as error:
        where = f"{doc.path} line {doc.line + 1}"
        raise DataError(f"{where}: expected a JSON object with a \"text\" field ({error})") from error
    if not isinstance(text, str):
        raise DataError(f"{doc.path} line {doc.line + 1}: \"text\" is {type(text).__name__}, expected a string")
    return text


def split_fraction_key(name: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, document name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_splits(names: Sequence[str], val_fraction: float, seed: int) -> list[str]:
    """'train' or 'val' per name: val when its seeded hash falls below `val_fraction`.

    Hashing names (not positions) keeps every document's split fixed when the
    corpus grows. With val_fraction > 0 and two or more documents, each split
    gets at least one: the smallest hash goes to val, the largest to train.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    if val_fraction > 0 and len(names) < 2:
        raise DataError(f"{len(names)} document(s) cannot make both a train and a val split; "
                        "add documents or set val_fraction=0")
    keys = [split_fraction_key(name, seed) for name in names]
    splits = ["val" if key < val_fraction else "train" for key in keys]
    if val_fraction > 0:
        splits[min(range(len(keys)), key=keys.__getitem__)] = "val"
        splits[max(range(len(keys)), key=keys.__getitem__)] = "train"
    return splits
