"""The run config's schema as text (`scaletrain config --keys`): every key, its type, default and meaning.

A key's meaning is the comment beside its field (and the comment lines just above it) in the
dataclass that declares it, read from the source, and a numeric key's range the one its field
declares (config.bounded): config.py and the families' config classes stay the one place a key is
described, and a new field shows up here without a second list to update.
The families' classes are handed in (families/__init__.py MODEL_SECTIONS), as to config.read_config.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Any

from scaletrain.config import Config, ModelConfig, ModelSections, ObjectiveConfig


@dataclass(frozen=True)
class SchemaKey:
    key: str  # dotted, as an override names it; the fields of list items as data.blend[].dir
    type: str
    default: Any  # dataclasses.MISSING for a field that must be given
    meaning: str
    allowed: str = ""  # a numeric key's range as its field declares it (config.bounded): `>= 1`, `in [0, 1)`

    def line(self) -> str:
        """`key: type [range] = default  # meaning`, the default as YAML reads it (JSON is a subset)."""
        allowed = f" {self.allowed}" if self.allowed else ""
        default = "" if self.default is dataclasses.MISSING else f" = {json.dumps(self.default)}"
        meaning = f"  # {self.meaning}" if self.meaning else ""
        return f"{self.key}: {self.type}{allowed}{default}{meaning}"


def schema_text(model_sections: ModelSections) -> str:
    header = ("# every key of a run config: KEY: TYPE = DEFAULT  # meaning (the model and objective sections are the\n"
              "# family's: the keys every family has, then each family's own, marked with its name)\n")
    return header + "".join(f"{key.line()}\n" for key in schema_keys(model_sections))


def schema_keys(model_sections: ModelSections) -> list[SchemaKey]:
    """Every leaf key, in the order of the dataclasses' fields; the model and objective keys of each family in
    `model_sections`."""
    hints = typing.get_type_hints(Config)
    keys = []
    for section in dataclasses.fields(Config):
        keys.extend(_keys(hints[section.name], f"{section.name}."))
        if section.name == "model":
            keys.extend(_family_keys(model_sections))
        if section.name == "objective":
            keys.extend(_objective_keys(model_sections))
    return keys


def _keys(cls: type, prefix: str, marker: str = "", skip: frozenset[str] = frozenset()) -> list[SchemaKey]:
    """The fields of one dataclass as keys under `prefix`; a nested dataclass (model.moe) as its own keys,
    `prefix.name.field`, and a list of dataclasses (data.blend) as its items' keys, `prefix.name[].field`."""
    hints, meanings = typing.get_type_hints(cls), _field_comments(cls)
    keys = []
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):  # a nested section (model.moe): its keys, model.moe.top_k ...
            keys.extend(_keys(hint, f"{prefix}{field.name}.", marker))
            continue
        meaning = f"{marker} {meanings.get(field.name, '')}".strip()
        allowed = field.metadata["allowed"].phrase if "allowed" in field.metadata else ""
        keys.append(SchemaKey(f"{prefix}{field.name}", _type_name(hint), _default(field), meaning, allowed))
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if dataclasses.is_dataclass(item):
            keys.extend(_keys(item, f"{prefix}{field.name}[].", marker))
    return keys


def _family_keys(model_sections: ModelSections) -> list[SchemaKey]:
    """The keys a family's config class adds to the shared model keys, marked `(family)`."""
    shared = frozenset(field.name for field in dataclasses.fields(ModelConfig))
    return [key for family, section in model_sections.items()
            for key in _keys(section, "model.", f"({family})", shared)]


def _objective_keys(model_sections: ModelSections) -> list[SchemaKey]:
    """The keys each family's objective section adds to `kind`, once per section class, marked with the
    families that share it (`(bert, albert)`)."""
    shared = frozenset(field.name for field in dataclasses.fields(ObjectiveConfig))
    families_of: dict[type, list[str]] = {}
    for family, section in model_sections.items():
        families_of.setdefault(section.objective_section, []).append(family)
    return [key for section, families in families_of.items()
            for key in _keys(section, "objective.", f"({', '.join(families)})", shared)]


def _default(field: dataclasses.Field) -> Any:
    return field.default if field.default_factory is dataclasses.MISSING else field.default_factory()


def _type_name(hint: Any) -> str:
    """int, int | None, list[str], list[BlendEntry]: as the field declares it, without module paths."""
    if isinstance(hint, types.UnionType):
        return " | ".join(_type_name(option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"list[{_type_name(typing.get_args(hint)[0])}]"
    return "None" if hint is type(None) else hint.__name__


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment, a subclass's own over its base's (LlamaConfig's layernorm_eps: RMSNorm eps)."""
    comments: dict[str, str] = {}
    for declaring in reversed(cls.__mro__):
        if dataclasses.is_dataclass(declaring):
            comments.update(_own_field_comments(declaring))
    return comments


def _own_field_comments(cls: type) -> dict[str, str]:
    """The comment lines just above each field the class body declares, then the comment after it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = {token.start[0]: token.string[1:].strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}

    def whole_line(row: int) -> bool:
        return row in comments and lines[row - 1].lstrip().startswith("#")

    meanings = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 1
        while whole_line(row):
            above.insert(0, comments[row])
            row -= 1
        after = [comments[node.end_lineno]] if node.end_lineno in comments and not whole_line(node.end_lineno) else []
        meanings[node.target.id] = " ".join(above + after)
    return meanings
