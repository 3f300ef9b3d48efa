"""Web-scale pretraining corpora (FineWeb-Edu, FineWeb, OpenWebText, Wikipedia, C4) -> .jsonl for `prepare`.

Each recipe streams one Hugging Face dataset with `datasets.load_dataset(..., streaming=True)`, so
nothing but the kept text is written to disk, and writes `{"text": ...}` lines into
OUT/part-00000.jsonl, part-00001.jsonl, ... (`--documents-per-file` each), which `scaletrain
prepare` reads one document a line. `--data-files` runs the same recipe (same text column, same
filters) over local parquet / jsonl(.gz) files instead of the Hub: a mirrored copy, or test data.

| recipe | dataset (config) | language handling |
| fineweb-edu | HuggingFaceFW/fineweb-edu ("sample-10BT") | English only: `language` == --language and |
|             |                                           | `language_score` >= --min-language-score |
| fineweb | HuggingFaceFW/fineweb ("sample-10BT") | as fineweb-edu |
| openwebtext | Skylion007/openwebtext (data/train-*.parquet) | English only, no column: --language must be en |
| wikipedia | wikimedia/wikipedia ("20231101.<language>") | the per-language config |
| c4 | allenai/c4 ("<language>": en is C4, other codes mC4) | the per-language config |

Every recipe drops empty documents and applies --min-chars, --max-chars and --min-words to the
normalised text; fineweb-edu also takes --min-edu-score (its `score` column). With --data-files,
Wikipedia and C4 files are taken to be in --language (they have no language column).

Sources for the ids, configs and columns: the dataset cards on huggingface.co/datasets/<id>.
FineWeb and FineWeb-Edu (Penedo et al. 2024, arXiv:2406.17557) carry `text, id, dump, url, date,
file_path, language, language_score, token_count` (FineWeb-Edu adds `score` and `int_score`, its
educational classifier's 0-5 rating, and keeps int_score >= 3); FineWeb kept English with a fastText
score >= 0.65, our default --min-language-score, so on the Hub's own rows it drops nothing until
raised. wikimedia/wikipedia has `id, url, title, text` per "<dump>.<lang>" config. allenai/c4 has
`text, timestamp, url`; its "en" config is C4 (Raffel et al. 2020, sec. 2.2), other language codes
are mC4 configs (huggingface.co/datasets/allenai/c4/discussions/6). Skylion007/openwebtext still
ships a loading script that datasets>=4 refuses ("Dataset scripts are no longer supported",
karpathy/nanoGPT#633), so its parquet shards are streamed with the generic parquet loader.

    python data_pipelines/web_corpora.py fineweb-edu --out data/raw/fineweb_edu [--max-documents N]
        [--language en] [--config sample-100BT] [--min-chars N] [--max-chars N] [--min-words N]
        [--documents-per-file N] [--data-files 'mirror/sample/10BT/*.parquet'] [--overwrite]

Whitespace is normalised (see `normalise_whitespace`); exact duplicates are left to `prepare`.
OUT is built in a staging directory beside it and renamed into place, with OUT/SOURCE.json
recording the settings and how many documents each filter dropped; a finished OUT with the same
settings is returned as is. Progress goes to stderr. Bad input (an unknown recipe, --data-files
matching nothing, a file without the text column) exits 2 with one line naming it and the fix.
"""

from __future__ import annotations

import argparse
import gc
import glob
import gzip
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from scaletrain.disk import replace_directory

RECIPE_VERSION = 1
SOURCE_NAME = "SOURCE.json"
FINEWEB_MIN_LANGUAGE_SCORE = 0.65  # FineWeb's own fastText English cut (its dataset card; Penedo et al. 2024)
PROGRESS_SECONDS = 10.0
PARQUET_SUFFIXES = (".parquet",)
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


class CorpusError(RuntimeError):
    """The corpus could not be built; the message names the recipe, file or option and the fix."""


@dataclass(frozen=True)
class Recipe:
    name: str
    dataset_id: str
    config_template: str | None  # "{language}" is replaced by --language
    language_handling: str  # one sentence for SOURCE.json: how --language is honoured
    text_column: str = "text"
    only_language: str | None = None  # the one language a monolingual dataset holds
    language_column: str | None = None
    language_score_column: str | None = None
    edu_score_column: str | None = None
    hub_parquet_files: str | None = None  # stream these with the generic parquet loader instead of the repo


RECIPES = {recipe.name: recipe for recipe in (
    Recipe("fineweb-edu", "HuggingFaceFW/fineweb-edu", "sample-10BT",
           "English only: keeps rows whose `language` is --language and `language_score` >= --min-language-score",
           only_language="en", language_column="language", language_score_column="language_score",
           edu_score_column="score"),
    Recipe("fineweb", "HuggingFaceFW/fineweb", "sample-10BT",
           "English only: keeps rows whose `language` is --language and `language_score` >= --min-language-score",
           only_language="en", language_column="language", language_score_column="language_score"),
    Recipe("openwebtext", "Skylion007/openwebtext", None,
           "English only (Reddit-linked English pages); no language column to filter on",
           only_language="en", hub_parquet_files="hf://datasets/Skylion007/openwebtext/data/train-*.parquet"),
    Recipe("wikipedia", "wikimedia/wikipedia", "20231101.{language}",
           "the per-language config 20231101.<language>; local --data-files are taken as that language"),
    Recipe("c4", "allenai/c4", "{language}",
           "the per-language config: en is C4, other codes mC4; local --data-files are taken as that language"),
)}


@dataclass(frozen=True)
class CorpusOptions:
    """What to stream and which documents to keep; recorded in SOURCE.json as the build's settings."""

    language: str = "en"
    config: str | None = None  # None: the recipe's config for `language`
    data_files: str | None = None  # a path, directory or glob of local parquet/jsonl files instead of the Hub
    text_column: str | None = None  # None: the recipe's
    max_documents: int | None = None
    documents_per_file: int = 100_000
    min_chars: int = 0
    max_chars: int | None = None
    min_words: int = 0
    min_language_score: float = FINEWEB_MIN_LANGUAGE_SCORE
    min_edu_score: float | None = None


def find_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise CorpusError(f"unknown recipe {name!r}; the recipes are {', '.join(RECIPES)}")
    return RECIPES[name]


def check_options(recipe: Recipe, options: CorpusOptions) -> None:
    """Reject settings that would silently build the wrong corpus (or nothing)."""
    if recipe.only_language is not None and options.language != recipe.only_language:
        multilingual = ", ".join(r.name for r in RECIPES.values() if r.only_language is None)
        raise CorpusError(f"{recipe.name} holds {recipe.only_language!r} text only, not --language "
                          f"{options.language!r}; use --language {recipe.only_language} or one of {multilingual}")
    if options.min_edu_score is not None and recipe.edu_score_column is None:
        raise CorpusError(f"--min-edu-score needs FineWeb-Edu's `score` column, which {recipe.name} lacks; "
                          "drop the option or use the fineweb-edu recipe")
    if options.config is not None and options.data_files is not None:
        raise CorpusError("--config picks a Hub config, but --data-files reads local files instead; drop one")
    if options.max_documents is not None and options.max_documents < 1:
        raise CorpusError(f"--max-documents {options.max_documents} must be at least 1")
    if options.documents_per_file < 1:
        raise CorpusError(f"--documents-per-file {options.documents_per_file} must be at least 1")
    if options.max_chars is not None and options.max_chars < max(options.min_chars, 1):
        raise CorpusError(f"--max-chars {options.max_chars} is below --min-chars {options.min_chars} "
                          "(or 1): every document would be dropped")


def hub_config(recipe: Recipe, options: CorpusOptions) -> str | None:
    """The Hub config streamed; None for local --data-files and for datasets without configs."""
    if options.data_files is not None:
        return None
    if options.config is not None:
        return options.config
    return None if recipe.config_template is None else recipe.config_template.format(language=options.language)


def normalise_whitespace(text: str) -> str:
    """One space between words, LF line ends, at most one blank line in a row, nothing at either end.

    Text extracted from HTML keeps layout runs of spaces, tabs and blank lines that carry no
    meaning; our tokenizer keeps whitespace as it is (`remove_extra_whitespaces=False`), so
    left alone they would spend vocabulary and context on padding. Paragraph breaks stay.
    """
    lines = (" ".join(line.split()) for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


DocumentFilter = tuple[str, Callable[[dict, str], bool]]  # (name in SOURCE.json, keep(row, normalised text))


def document_filters(recipe: Recipe, options: CorpusOptions) -> list[DocumentFilter]:
    """The filters this recipe applies with these options, cheapest (metadata) first."""
    filters: list[DocumentFilter] = []
    if recipe.language_column:
        filters.append(("language", lambda row, _: row[recipe.language_column] == options.language))
    if recipe.language_score_column:
        threshold = options.min_language_score
        filters.append(("language_score", lambda row, _: at_least(row[recipe.language_score_column], threshold)))
    if options.min_edu_score is not None:
        filters.append(("edu_score", lambda row, _: at_least(row[recipe.edu_score_column], options.min_edu_score)))
    filters.append(("empty", lambda _, text: bool(text)))
    if options.min_chars:
        filters.append(("min_chars", lambda _, text: len(text) >= options.min_chars))
    if options.max_chars is not None:
        filters.append(("max_chars", lambda _, text: len(text) <= options.max_chars))
    if options.min_words:
        filters.append(("min_words", lambda _, text: len(text.split()) >= options.min_words))
    return filters


def at_least(score: float | None, threshold: float) -> bool:
    """A missing (null) score fails the threshold rather than passing it unchecked."""
    return score is not None and score >= threshold


def required_columns(recipe: Recipe, options: CorpusOptions) -> list[str]:
    columns = [options.text_column or recipe.text_column, recipe.language_column, recipe.language_score_column]
    if options.min_edu_score is not None:
        columns.append(recipe.edu_score_column)
    return [column for column in columns if column]


def resolve_data_files(pattern: str) -> list[Path]:
    """The parquet or json(l) files named by a path, a directory (searched recursively) or a glob, sorted."""
    path = Path(pattern)
    matches = list(path.rglob("*")) if path.is_dir() else [Path(p) for p in glob.glob(pattern, recursive=True)]
    files = sorted(p.resolve() for p in matches if p.is_file() and p.name.endswith(PARQUET_SUFFIXES + JSON_SUFFIXES))
    if not files:
        raise CorpusError(f"--data-files {pattern!r} matches no {', '.join(PARQUET_SUFFIXES + JSON_SUFFIXES)} "
                          "files; check the path, and quote a glob so the shell does not expand it")
    kinds = {file_format(file) for file in files}
    if len(kinds) > 1:
        raise CorpusError(f"--data-files {pattern!r} mixes parquet and json files; run once per format "
                          "into separate --out directories")
    return files


def file_format(path: Path) -> str:
    return "parquet" if path.name.endswith(PARQUET_SUFFIXES) else "json"


def file_columns(path: Path) -> list[str]:
    """Column names of a parquet file (its schema) or a json(l) file (its first record's keys)."""
    if file_format(path) == "parquet":
        import pyarrow
        import pyarrow.parquet

        try:
            return pyarrow.parquet.read_schema(path).names
        except pyarrow.ArrowException as error:
            raise CorpusError(f"{path} is not a readable parquet file ({error}); re-download it or leave it "
                              "out of --data-files") from None
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        first = next((line for line in lines if line.strip()), None)
    if first is None:
        raise CorpusError(f"{path} holds no records; remove it from --data-files")
    try:
        record = json.loads(first)
    except ValueError as error:
        raise CorpusError(f"{path}: the first record is not JSON ({error}); --data-files takes json lines") from None
    return list(record) if isinstance(record, dict) else []


def check_columns(files: list[Path], columns: list[str], recipe: Recipe) -> None:
    for path in files:
        present = file_columns(path)
        missing = [column for column in columns if column not in present]
        if missing:
            raise CorpusError(
                f"{path} has no {describe_columns(missing)} (it has {present}), which the {recipe.name} "
                f"recipe reads; point --data-files at {recipe.dataset_id} files, or pass --text-column NAME if "
                "the text is under another name")


def describe_columns(names: list[str]) -> str:
    return f"{'column' if len(names) == 1 else 'columns'} {', '.join(map(repr, names))}"


def open_stream(recipe: Recipe, options: CorpusOptions, data_files: list[Path] | None) -> Iterable[dict]:
    """Rows of the recipe's train split, streamed from local files or the Hub."""
    try:
        import datasets
    except ImportError:
        raise CorpusError("the web corpus recipes need Hugging Face `datasets`: "
                          "pip install -e '.[corpora]'") from None
    if data_files is not None:
        return datasets.load_dataset(file_format(data_files[0]), data_files=[str(p) for p in data_files],
                                     split="train", streaming=True)
    try:
        if recipe.hub_parquet_files is not None:
            return datasets.load_dataset("parquet", data_files=recipe.hub_parquet_files, split="train",
                                         streaming=True)
        return datasets.load_dataset(recipe.dataset_id, hub_config(recipe, options), split="train", streaming=True)
    except (ConnectionError, FileNotFoundError, ValueError) as error:
        raise CorpusError(f"could not open {recipe.dataset_id} ({hub_config(recipe, options)}) on the Hugging Face "
                          f"Hub: {error}. Check the network, the config name (--config) and HF_TOKEN for gated "
                          "datasets, or mirror the files and pass --data-files") from None


class PartWriter:
    """`{"text": ...}` lines into part-00000.jsonl, part-00001.jsonl, ..., `documents_per_file` a file."""

    def __init__(self, directory: Path, documents_per_file: int) -> None:
        self.directory, self.documents_per_file = directory, documents_per_file
        self.files: list[str] = []
        self.in_file = 0
        self.handle = None

    def write(self, text: str) -> None:
        if self.handle is None or self.in_file == self.documents_per_file:
            self.close()
            self.files.append(f"part-{len(self.files):05d}.jsonl")
            self.handle = (self.directory / self.files[-1]).open("w", encoding="utf-8")
            self.in_file = 0
        self.handle.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        self.in_file += 1

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def filter_documents(
    rows: Iterable[dict], columns: list[str], filters: list[DocumentFilter], counts: dict, source: str,
) -> Iterator[str]:
    """Normalised texts of the rows every filter keeps; `counts` tallies rows read and each filter's drops.

    `columns` (the text column first) are checked on the first row: local files were checked
    before streaming, but a Hub dataset's columns are known only once it yields.
    """
    text_column = columns[0]
    for row in rows:
        counts["read"] += 1
        if counts["read"] == 1 and any(column not in row for column in columns):
            missing = [column for column in columns if column not in row]
            raise CorpusError(f"{source} rows have no {describe_columns(missing)} (they have "
                              f"{sorted(row)}); pass --text-column NAME if the text is under another name")
        text = normalise_whitespace(row[text_column] or "")
        failed = next((name for name, keep in filters if not keep(row, text)), None)
        if failed is None:
            yield text
        else:
            counts["dropped"][failed] += 1


def write_documents(texts: Iterable[str], staging: Path, options: CorpusOptions, counts: dict,
                    log: Callable[[str], None], label: str) -> list[str]:
    """Write up to max_documents texts into staging's part files; return their names."""
    writer = PartWriter(staging, options.documents_per_file)
    last_report = time.monotonic()
    try:
        for text in texts:
            writer.write(text)
            counts["kept"] += 1
            counts["characters"] += len(text)
            if time.monotonic() - last_report >= PROGRESS_SECONDS:
                log(f"{label}: read {counts['read']:,}, kept {counts['kept']:,} into {writer.files[-1]}")
                last_report = time.monotonic()
            if counts["kept"] == options.max_documents:
                break
    finally:
        writer.close()
    return writer.files


def build_corpus(
    recipe_name: str, out_dir: Path, options: CorpusOptions, overwrite: bool = False,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict:
    """Stream the recipe's corpus into out_dir (atomically) and return what SOURCE.json records."""
    recipe = find_recipe(recipe_name)
    check_options(recipe, options)
    out_dir = Path(out_dir)
    data_files = None if options.data_files is None else resolve_data_files(options.data_files)
    if data_files is not None:
        check_columns(data_files, required_columns(recipe, options), recipe)
    settings = corpus_settings(recipe, options, data_files)
    existing = read_source(out_dir)
    if existing is not None and existing["settings"] == settings and not overwrite:
        log(f"{recipe.name}: {out_dir} already holds this corpus ({existing['counts']['kept']:,} documents)")
        return existing
    check_target(out_dir, existing, overwrite)
    filters = document_filters(recipe, options)
    counts = {"read": 0, "kept": 0, "characters": 0, "dropped": {name: 0 for name, _ in filters}}
    source = options.data_files or f"{recipe.dataset_id} ({settings['config']})"
    log(f"{recipe.name}: streaming {source} into {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the corpus from other users' jobs
        texts = filter_documents(open_stream(recipe, options, data_files), required_columns(recipe, options),
                                 filters, counts, source)
        try:
            files = write_documents(texts, staging, options, counts, log, recipe.name)
        except (ValueError, OSError) as error:  # a corrupt file (pyarrow raises ValueErrors), a dropped connection
            raise CorpusError(f"reading {source} failed after {counts['read']:,} rows: {error}; replace the file "
                              "or check the network, then run again") from error
        finally:
            close_stream(texts)
        if not files:
            raise CorpusError(f"no document of {source} passed the filters ({counts['read']:,} read, dropped: "
                              f"{counts['dropped']}); loosen the filters or check --language")
        summary = {"recipe_version": RECIPE_VERSION, "settings": settings, "counts": counts, "files": files}
        (staging / SOURCE_NAME).write_text(json.dumps(summary, indent=1) + "\n")
        replace_directory(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"{recipe.name}: kept {counts['kept']:,} of {counts['read']:,} documents "
        f"({counts['characters']:,} characters) in {len(files)} files in {out_dir}; dropped {counts['dropped']}")
    return summary


def close_stream(texts: Iterator[str]) -> None:
    """End the row stream now, while pyarrow is alive. A parquet stream's reader left for the interpreter's
    final teardown can abort the process after all the work succeeded ("terminate called without an
    active exception", exit -6: apache/arrow#45214, huggingface/datasets#7566); closing the generator
    frees the dataset's iterator, and a collection frees any cycle that still holds it."""
    texts.close()
    gc.collect()


def corpus_settings(recipe: Recipe, options: CorpusOptions, data_files: list[Path] | None) -> dict:
    """The recipe, where the rows come from and every option: what SOURCE.json compares to reuse a build."""
    settings = {"recipe": recipe.name, "dataset_id": recipe.dataset_id, "config": hub_config(recipe, options),
                "language_handling": recipe.language_handling}
    if data_files is None and recipe.hub_parquet_files is not None:
        settings["hub_files"] = recipe.hub_parquet_files
    options = replace(options, text_column=options.text_column or recipe.text_column)
    settings.update({key: value for key, value in asdict(options).items() if key != "config"})
    settings["data_files"] = None if data_files is None else [str(path) for path in data_files]
    return settings


def read_source(out_dir: Path) -> dict | None:
    """SOURCE.json of a corpus this recipe version finished in out_dir, else None."""
    try:
        summary = json.loads((out_dir / SOURCE_NAME).read_text())
    except (OSError, ValueError):
        return None
    complete = all((out_dir / name).is_file() for name in summary.get("files", []))
    return summary if summary.get("recipe_version") == RECIPE_VERSION and complete else None


def check_target(out_dir: Path, existing: dict | None, overwrite: bool) -> None:
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    if existing is None:
        raise CorpusError(f"{out_dir} exists and is not a corpus built by this recipe; remove it or pick another --out")
    if not overwrite:
        raise CorpusError(f"{out_dir} holds a {existing['settings']['recipe']} corpus built with other settings; "
                          "pass --overwrite to replace it or pick another --out")


def parse_arguments(argv: list[str] | None) -> tuple[argparse.Namespace, CorpusOptions]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help=f"one of {', '.join(RECIPES)}")
    parser.add_argument("--out", type=Path, required=True, help="directory for part-*.jsonl and SOURCE.json")
    parser.add_argument("--language", default="en", help="language code (default en)")
    parser.add_argument("--config", help="Hub config instead of the recipe's (e.g. fineweb-edu sample-100BT)")
    parser.add_argument("--data-files", help="local parquet/jsonl path, directory or quoted glob instead of the Hub")
    parser.add_argument("--text-column", help="column holding the text, where local files name it differently")
    parser.add_argument("--max-documents", type=int, help="stop after keeping this many documents")
    parser.add_argument("--documents-per-file", type=int, default=CorpusOptions.documents_per_file)
    parser.add_argument("--min-chars", type=int, default=0, help="drop documents shorter than this")
    parser.add_argument("--max-chars", type=int, help="drop documents longer than this")
    parser.add_argument("--min-words", type=int, default=0, help="drop documents with fewer words")
    parser.add_argument("--min-language-score", type=float, default=FINEWEB_MIN_LANGUAGE_SCORE,
                        help="FineWeb recipes: drop rows whose language_score is lower")
    parser.add_argument("--min-edu-score", type=float, help="fineweb-edu: drop rows whose edu `score` is lower")
    parser.add_argument("--overwrite", action="store_true", help="replace an OUT built with other settings")
    args = parser.parse_args(argv)
    options = CorpusOptions(
        language=args.language, config=args.config, data_files=args.data_files, text_column=args.text_column,
        max_documents=args.max_documents, documents_per_file=args.documents_per_file, min_chars=args.min_chars,
        max_chars=args.max_chars, min_words=args.min_words, min_language_score=args.min_language_score,
        min_edu_score=args.min_edu_score)
    return args, options


def main(argv: list[str] | None = None) -> int:
    args, options = parse_arguments(argv)
    try:
        build_corpus(args.recipe, args.out, options, overwrite=args.overwrite)
    except CorpusError as error:
        print(f"web corpora: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
