"""The web corpus recipes over local files shaped like each Hub dataset: filters, cap, rollover, SOURCE.json."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipelines.web_corpora import CorpusError, CorpusOptions, build_corpus, main, normalise_whitespace

REPO_ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the", "river", "runs", "past", "an", "old", "mill", "where", "farmers", "bring", "grain", "each",
         "autumn", "and", "millers", "grind", "it", "into", "flour", "for", "bread", "sold", "in", "town",
         "market", "on", "days", "children", "watch", "wheel", "turn")


def prose(seed: int, num_words: int) -> str:
    """Seeded sentences of WORDS: enough repeated structure for a tiny BPE tokenizer to learn merges."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(num_words)]
    sentences = [" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, num_words, 12)]
    return "\n\n".join(" ".join(sentences[i:i + 3]) for i in range(0, len(sentences), 3))


def fineweb_edu_row(n: int, text: str, language: str = "en", language_score: float = 0.9, score: float = 3.5) -> dict:
    return {"text": text, "id": f"<urn:uuid:{n}>", "dump": "CC-MAIN-2024-10", "url": f"https://example.org/{n}",
            "file_path": "s3://commoncrawl/x.warc.gz", "language": language, "language_score": language_score,
            "token_count": len(text.split()), "score": score, "int_score": round(score)}


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as file:
            file.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def read_parts(out: Path) -> list[list[str]]:
    return [[json.loads(line)["text"] for line in (out / name).read_text().splitlines()]
            for name in json.loads((out / "SOURCE.json").read_text())["files"]]


@pytest.fixture
def fineweb_edu_files(tmp_path: Path) -> Path:
    """Two parquet shards: 8 good rows, and one row failing each filter in turn."""
    good = [fineweb_edu_row(n, prose(n, 40)) for n in range(8)]
    bad = [fineweb_edu_row(100, prose(100, 40), language="fr"),
           fineweb_edu_row(101, prose(101, 40), language_score=0.5),
           fineweb_edu_row(102, prose(102, 40), score=2.4),
           fineweb_edu_row(103, " \n\t "),
           fineweb_edu_row(104, "Too short to keep."),
           fineweb_edu_row(105, prose(105, 400)),
           fineweb_edu_row(106, "x" * 120)]  # long enough in characters, one word
    write_parquet(tmp_path / "mirror" / "sample" / "10BT" / "000_00000.parquet", good[:4] + bad[:4])
    write_parquet(tmp_path / "mirror" / "sample" / "10BT" / "001_00000.parquet", good[4:] + bad[4:])
    return tmp_path / "mirror"


FILTERS = {"min_edu_score": 3.0, "min_chars": 100, "max_chars": 1000, "min_words": 10}


def test_fineweb_edu_filters_roll_over_and_count(fineweb_edu_files: Path, tmp_path: Path) -> None:
    options = CorpusOptions(data_files=str(fineweb_edu_files), documents_per_file=3, **FILTERS)
    summary = build_corpus("fineweb-edu", tmp_path / "out", options, log=lambda line: None)
    parts = read_parts(tmp_path / "out")
    assert [len(part) for part in parts] == [3, 3, 2]
    assert [text for part in parts for text in part] == [normalise_whitespace(prose(n, 40)) for n in range(8)]
    counts = summary["counts"]
    assert counts["read"] == 15 and counts["kept"] == 8
    assert counts["dropped"] == {"language": 1, "language_score": 1, "edu_score": 1, "empty": 1,
                                 "min_chars": 1, "max_chars": 1, "min_words": 1}
    on_disk = json.loads((tmp_path / "out" / "SOURCE.json").read_text())
    assert on_disk == summary and on_disk["files"] == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    assert on_disk["settings"]["dataset_id"] == "HuggingFaceFW/fineweb-edu" and on_disk["settings"]["min_chars"] == 100
    assert len(on_disk["settings"]["data_files"]) == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def test_max_documents_stops_the_stream(fineweb_edu_files: Path, tmp_path: Path) -> None:
    options = CorpusOptions(data_files=str(fineweb_edu_files / "**" / "*.parquet"), max_documents=5,
                            documents_per_file=2)
    summary = build_corpus("fineweb", tmp_path / "out", options, log=lambda line: None)
    assert [len(part) for part in read_parts(tmp_path / "out")] == [2, 2, 1]
    assert summary["counts"]["kept"] == 5
    # the first shard's 4 good rows, its 'fr' and low-language-score rows, then its low-edu-score row (kept)
    assert summary["counts"]["read"] == 7
    assert summary["counts"]["dropped"] == {"language": 1, "language_score": 1, "empty": 0}


def test_wikipedia_and_c4_read_jsonl_and_normalise_whitespace(tmp_path: Path) -> None:
    wiki = [{"id": str(n), "url": f"https://en.wikipedia.org/wiki?curid={n}", "title": f"Article {n}",
             "text": f"Article {n}\r\n\r\n\r\n\r\nIt   is\tabout   mills.  \n"} for n in range(3)]
    write_jsonl(tmp_path / "wiki" / "train.jsonl", wiki)
    build_corpus("wikipedia", tmp_path / "wiki_out", CorpusOptions(data_files=str(tmp_path / "wiki")),
                 log=lambda line: None)
    assert read_parts(tmp_path / "wiki_out") == [[f"Article {n}\n\nIt is about mills." for n in range(3)]]

    c4 = [{"text": prose(n, 30), "timestamp": "2019-04-25T12:57:54Z", "url": f"https://c4.example/{n}"}
          for n in range(4)] + [{"text": "", "timestamp": "2019-04-25T12:57:54Z", "url": "https://c4.example/e"}]
    write_jsonl(tmp_path / "c4" / "en" / "c4-train.00000-of-01024.json.gz", c4)
    summary = build_corpus("c4", tmp_path / "c4_out", CorpusOptions(data_files=str(tmp_path / "c4" / "en" / "*")),
                           log=lambda line: None)
    assert summary["counts"] == {"read": 5, "kept": 4, "characters": sum(len(prose(n, 30)) for n in range(4)),
                                 "dropped": {"empty": 1}}
    assert summary["settings"]["config"] is None and summary["settings"]["dataset_id"] == "allenai/c4"


def test_a_finished_corpus_is_reused_and_other_settings_need_overwrite(fineweb_edu_files: Path,
                                                                        tmp_path: Path) -> None:
    out = tmp_path / "out"
    options = CorpusOptions(data_files=str(fineweb_edu_files), max_documents=3)
    build_corpus("fineweb-edu", out, options, log=lambda line: None)
    stamp = (out / "part-00000.jsonl").stat().st_mtime_ns
    build_corpus("fineweb-edu", out, options, log=lambda line: None)
    assert (out / "part-00000.jsonl").stat().st_mtime_ns == stamp
    with pytest.raises(CorpusError, match="built with other settings; pass --overwrite"):
        build_corpus("fineweb-edu", out, CorpusOptions(data_files=str(fineweb_edu_files)), log=lambda line: None)
    summary = build_corpus("fineweb-edu", out, CorpusOptions(data_files=str(fineweb_edu_files)), overwrite=True,
                           log=lambda line: None)
    assert summary["counts"]["kept"] == 12 and sum(map(len, read_parts(out))) == 12


def test_a_failure_mid_stream_leaves_the_previous_corpus(tmp_path: Path) -> None:
    rows = [{"text": prose(n, 20)} for n in range(3)]
    write_jsonl(tmp_path / "good" / "a.jsonl", rows)
    out = tmp_path / "out"
    build_corpus("openwebtext", out, CorpusOptions(data_files=str(tmp_path / "good")), log=lambda line: None)
    before = read_parts(out)
    broken = write_jsonl(tmp_path / "broken" / "a.jsonl", rows)
    with broken.open("a") as file:
        file.write("{not json\n")
    with pytest.raises(CorpusError, match=r"reading .*broken failed after \d+ rows: .*JSON"):
        build_corpus("openwebtext", out, CorpusOptions(data_files=str(tmp_path / "broken")), overwrite=True,
                     log=lambda line: None)
    assert read_parts(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "good", "out"]


@pytest.mark.parametrize(("recipe", "options", "message"), [
    ("fineweb-edu2", CorpusOptions(), "unknown recipe 'fineweb-edu2'; the recipes are fineweb-edu, fineweb, "),
    ("fineweb", CorpusOptions(data_files="{tmp}/nowhere/*.parquet"), r"matches no \.parquet"),
    ("openwebtext", CorpusOptions(data_files="{tmp}/no_text"), r"no_text/a\.parquet has no column 'text' .*'body'.*"
     "--text-column NAME"),
    ("fineweb-edu", CorpusOptions(data_files="{tmp}/no_text", text_column="body"),
     r"has no columns 'language', 'language_score'"),
    ("openwebtext", CorpusOptions(language="de"), "holds 'en' text only, not --language 'de'"),
    ("fineweb", CorpusOptions(min_edu_score=3.0), "--min-edu-score needs FineWeb-Edu's `score` column"),
    ("wikipedia", CorpusOptions(data_files="{tmp}/no_text", config="20231101.de"), "--config picks a Hub config"),
])
def test_bad_input_is_one_clear_error(recipe: str, options: CorpusOptions, message: str, tmp_path: Path) -> None:
    write_parquet(tmp_path / "no_text" / "a.parquet", [{"body": "text under another name"}])
    if options.data_files:
        options = replace(options, data_files=options.data_files.format(tmp=tmp_path))
    with pytest.raises(CorpusError, match=message):
        build_corpus(recipe, tmp_path / "out", options, log=lambda line: None)
    assert not (tmp_path / "out").exists()


def test_text_column_override_reads_renamed_text(tmp_path: Path) -> None:
    write_parquet(tmp_path / "renamed" / "a.parquet", [{"body": prose(n, 20)} for n in range(2)])
    summary = build_corpus("openwebtext", tmp_path / "out", CorpusOptions(data_files=str(tmp_path / "renamed"),
                                                                         text_column="body"), log=lambda line: None)
    assert summary["counts"]["kept"] == 2 and summary["settings"]["text_column"] == "body"


def test_main_reports_errors_on_stderr_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["c5", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == ("web corpora: error: unknown recipe 'c5'; the recipes are "
                                               "fineweb-edu, fineweb, openwebtext, wikipedia, c4")


def test_cli_output_is_what_prepare_reads(fineweb_edu_files: Path, tmp_path: Path) -> None:
    from scaletrain.data.prepare import prepare_dataset

    out = tmp_path / "raw" / "fineweb_edu"
    command = [sys.executable, str(REPO_ROOT / "data_pipelines" / "web_corpora.py"), "fineweb-edu", "--out", str(out),
               "--data-files", str(fineweb_edu_files / "sample" / "10BT" / "*.parquet"), "--documents-per-file", "5",
               "--min-words", "10", "--max-chars", "1000"]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fineweb-edu: kept 9 of 15 documents" in result.stderr and result.stdout == ""
    assert [len(part) for part in read_parts(out)] == [5, 4]
    manifest = prepare_dataset([out], tmp_path / "data", vocab_size=300, num_sentinels=0, val_fraction=0.2,
                               max_tokens_per_shard=100_000, num_workers=1, seed=0)
    assert sum(split.num_docs for split in manifest.splits.values()) == 9
    assert set(manifest.splits) == {"train", "val"}
