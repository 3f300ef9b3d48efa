"""The English corpus recipe: RST to prose, duplicate removal, and sources that cannot be fetched."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from data_pipelines.english import (
    SOURCES,
    CorpusError,
    Source,
    SourceUnavailable,
    _run_client,
    apt_fetch,
    build,
    drop_duplicates,
    normalised,
)
from data_pipelines.rst_text import rst_to_text

RST = """\
.. SPDX-License-Identifier: GPL-2.0

==============
Writing drivers
==============

:Author: Someone <someone@example.org>

Call :c:func:`pci_register_driver` with a ``struct pci_driver``; see `the book <https://lwn.net>`_
and **read it**.

Example::

    static int probe(struct pci_dev *dev)
    {
        return 0;
    }

.. code-block:: c

   int not_prose = 1;

.. toctree::
   :maxdepth: 2

   other

.. function:: open(file, mode='r')

   Open *file* and return a file object.

>>> open('x')
<file>

+-------+-------+
| table | cells |
+-------+-------+
"""


def test_rst_keeps_prose_and_drops_code_tables_and_markup() -> None:
    text = rst_to_text(RST)
    assert "Writing drivers" in text and "=====" not in text
    assert "Call pci_register_driver with a struct pci_driver; see the book" in text
    assert "and read it." in text
    assert "Example:" in text and "probe" not in text and "not_prose" not in text
    assert "Open file and return a file object." in text  # a prose directive keeps its body
    assert "maxdepth" not in text and "other" not in text.split()
    assert ">>>" not in text and "table" not in text and "SPDX" not in text and "Author" not in text
    assert ":c:func:" not in text and "``" not in text and "`_" not in text


def test_exact_and_near_duplicates_are_dropped() -> None:
    words = [f"word{i}" for i in range(400)]
    original = " ".join(words)
    near = " ".join(words[:390] + ["changed"] * 10)  # 97% of the 3-grams shared
    distinct = " ".join(reversed(words))
    documents = {"a/original": original, "b/copy": original.upper(), "c/near": near, "d/distinct": distinct}
    kept, counts = drop_duplicates(documents)
    assert sorted(kept) == ["a/original", "d/distinct"]
    assert counts == {"exact_duplicates": 1, "near_duplicates": 1}
    assert normalised("Hello,  World!") == "hello world"


def _fake_source(name: str, texts: dict[str, str], tmp_path: Path, client: str | None = None) -> Source:
    def fetch(cache: Path) -> Path:
        if client is not None:
            _run_client([client, "pack"], tmp_path, f"install {client}")
        archive = tmp_path / f"{name}.json"
        archive.write_text(json.dumps(texts))
        return archive

    return Source(name, f"{name}@1.0", "CC0", f"{name} license\n", fetch,
                  lambda archive: json.loads(archive.read_text()))


def test_a_source_that_cannot_be_fetched_is_skipped(tmp_path: Path) -> None:
    prose = {f"doc{i}.txt": " ".join(f"w{i}x{j}" for j in range(80)) for i in range(3)}
    sources = [_fake_source("good", prose, tmp_path),
               _fake_source("missing", prose, tmp_path, client="no-such-registry-client")]
    warnings: list[str] = []
    summary = build(tmp_path / "corpus", tmp_path / "cache", set(), min_words=100, log=warnings.append,
                    sources=sources)
    assert len(warnings) == 1 and "missing" in warnings[0] and "no-such-registry-client" in warnings[0]
    assert "skipped" in summary["sources"]["missing"]
    assert summary["sources"]["good"]["documents"] == 3
    assert sorted(p.name for p in (tmp_path / "corpus" / "good").iterdir()) == [
        "LICENSE.md", "doc0.txt", "doc1.txt", "doc2.txt"]
    assert not (tmp_path / "corpus" / "missing").exists()


def test_too_little_text_fails_without_writing(tmp_path: Path) -> None:
    sources = [_fake_source("tiny", {"a.txt": "short " * 60}, tmp_path)]
    with pytest.raises(CorpusError, match="minimum 1,000"):
        build(tmp_path / "corpus", tmp_path / "cache", set(), min_words=1000, log=lambda _: None, sources=sources)
    assert not (tmp_path / "corpus").exists()
    assert not list(tmp_path.glob(".corpus.tmp-*"))


def test_a_debian_source_takes_its_pinned_version_not_the_newest(tmp_path: Path) -> None:
    """A machine whose cache (or apt) holds a newer .deb still builds the pinned corpus: a bare
    `apt-get download` took 6.1.192-3 over the experiment's 6.1.176-1 on 2026-11-29."""
    for name in ("pkg_1.0-1_all.deb", "pkg_1.2-3_all.deb"):
        (tmp_path / name).write_bytes(name.encode())
    assert apt_fetch("pkg", "1.0-1")(tmp_path) == tmp_path / "pkg_1.0-1_all.deb"
    assert apt_fetch("pkg", "2:1.2-3")(tmp_path) == tmp_path / "pkg_1.2-3_all.deb"  # file names drop the epoch


def test_a_debian_version_gone_from_apt_names_where_to_get_it(tmp_path: Path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apt = bin_dir / "apt-get"  # apt 2.6's message for a version its lists do not hold, and its exit status
    apt.write_text("#!/bin/sh\necho \"E: Version '1.0-1' for 'pkg' was not found\" >&2\nexit 100\n")
    apt.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    with pytest.raises(SourceUnavailable) as raised:
        apt_fetch("pkg", "1.0-1")(tmp_path / "cache")
    message = str(raised.value)
    assert "pkg_1.0-1_all.deb" in message and "https://snapshot.debian.org/binary/pkg/" in message
    assert str(tmp_path / "cache") in message
    assert not [path for path in (tmp_path / "cache").iterdir()]  # no download directory left behind


def test_the_debian_sources_are_pinned_by_version_and_hash() -> None:
    debian = [source for source in SOURCES if "(Debian)" in source.package]
    assert [source.name for source in debian] == ["linux_docs", "python_docs"]
    assert all("=" in source.package and source.sha256 for source in debian)
