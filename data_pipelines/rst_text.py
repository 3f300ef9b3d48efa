"""reStructuredText (Sphinx `_sources/*.rst.txt`) -> plain prose for language-model training.

Kept: paragraphs, section titles, list items, and the prose bodies of directives such as
`.. note::` or Python's `.. function::`. Dropped: code (literal blocks after `::`, code-block,
literalinclude, doctest `>>>` blocks), tables, comments, toctrees, substitutions, link targets,
field lists and section underlines. Inline markup keeps its text: :func:`open` -> open,
``x`` -> x, `text <url>`_ -> text, **bold** -> bold.
"""

from __future__ import annotations

import re

# Directives whose whole block is code, layout or metadata, not prose.
DROPPED_DIRECTIVES = frozenset({
    "code-block", "code", "sourcecode", "literalinclude", "toctree", "highlight", "image", "figure", "table",
    "csv-table", "list-table", "flat-table", "tabularcolumns", "kernel-doc", "kernel-feat", "kernel-abi",
    "kernel-figure", "kernel-render", "kernel-include", "raw", "include", "index", "productionlist", "doctest",
    "testcode", "testoutput", "testsetup", "testcleanup", "graphviz", "math", "cssclass", "only", "maxdepth",
    "parsed-literal", "audit-event", "impl-detail", "miscnews", "program", "option", "cmdoption",
})
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(?:[\w-]+:)?([\w-]+)::\s*(.*)$")
_COMMENT_OR_TARGET = re.compile(r"^(\s*)\.\.(\s|$)")
_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+<>_:.])\1{2,}\s*$")
_SIMPLE_TABLE_BORDER = re.compile(r"^\s*=+(\s+=+)+\s*$")
_GRID_TABLE = re.compile(r"^\s*[+|]")
_FIELD = re.compile(r"^\s*:[\w -]+:(\s|$)")
_ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
_REFERENCE = re.compile(r"`([^`<]*?)\s*(<[^>]*>)?`_{1,2}")
_LITERAL = re.compile(r"``([^`]+)``")
_INTERPRETED = re.compile(r"`([^`]+)`")
_EMPHASIS = re.compile(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*")
_SUBSTITUTION = re.compile(r"\|([\w -]+)\|_{0,2}")
_FOOTNOTE = re.compile(r"\s*\[(#|\*|\d+|#\w+)\]_")


def rst_to_text(source: str) -> str:
    """Plain paragraphs, blank-line separated, from one RST document."""
    lines = _drop_blocks(source.replace("\t", "    ").splitlines())
    kept = []
    for line in lines:
        if _UNDERLINE.match(line) or _SIMPLE_TABLE_BORDER.match(line) or _GRID_TABLE.match(line) or _FIELD.match(line):
            continue
        kept.append(inline_to_text(line).strip())
    text = "\n".join(kept)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def inline_to_text(line: str) -> str:
    def role_text(match: re.Match) -> str:
        inner = match.group(1)
        explicit = re.match(r"(.*?)\s*<[^>]*>$", inner)  # :ref:`title <target>` -> title
        return (explicit.group(1) if explicit and explicit.group(1) else inner).lstrip("~!")

    line = _ROLE.sub(role_text, line)
    line = _LITERAL.sub(r"\1", line)
    line = _REFERENCE.sub(lambda m: m.group(1) or (m.group(2) or "").strip("<>"), line)
    line = _INTERPRETED.sub(r"\1", line)
    line = _EMPHASIS.sub(lambda m: m.group(1) or m.group(2), line)
    line = _FOOTNOTE.sub("", line)
    line = _SUBSTITUTION.sub(r"\1", line)
    return line.replace("\\", "")


def _drop_blocks(lines: list[str]) -> list[str]:
    """Remove code blocks, comments and layout directives; unwrap the bodies of prose directives."""
    kept: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        directive = _DIRECTIVE.match(line)
        if directive:
            body_end = _block_end(lines, index + 1, indent)
            if directive.group(2) not in DROPPED_DIRECTIVES:
                body = [entry for entry in lines[index + 1:body_end] if not _FIELD.match(entry)]
                kept.extend(_drop_blocks(body))
            index = body_end
            continue
        if _COMMENT_OR_TARGET.match(line) or stripped.startswith(">>>"):
            index = _block_end(lines, index + 1, indent) if not stripped.startswith(">>>") else \
                _paragraph_end(lines, index)
            continue
        if stripped.endswith("::"):
            text = stripped[:-2].rstrip()
            if text:
                kept.append(line[:indent] + text + ":")
            index = _block_end(lines, index + 1, indent)  # the literal block that follows
            continue
        kept.append(line)
        index += 1
    return kept


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """The first line after `start` that is neither blank nor indented deeper than `indent`."""
    index = start
    while index < len(lines):
        line = lines[index]
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        index += 1
    return index


def _paragraph_end(lines: list[str], start: int) -> int:
    index = start
    while index < len(lines) and lines[index].strip():
        index += 1
    return index
