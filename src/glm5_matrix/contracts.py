"""The one reader of the project's TOML data files: matrix.toml, profiles/NAME/profile.toml,
envs/NAME.toml, known-failures.toml, mutants/catalogue.toml and upstream/NAME/finding.toml.

Each file's contract is declared as data beside its loader (a `Spec` tree: every table and key,
its type, whether it is required, its default, its range, choices or pattern, and the rules over
several keys), and `read` checks a whole file against it when it is loaded, before anything is
built: unknown keys (with the nearest valid name, as cibuildwheel names an option's), types,
required keys, ranges. Every problem is one line naming the file, the table and the key
(`matrix.toml: cells.e2e-cpu.gpu: unknown key; did you mean 'gpus'?`), all of a file's problems
at once.

Why a reader of its own rather than jsonschema at load: nox imports the noxfile, which reads
matrix.toml, in nox's own interpreter (a bare `pip install nox` or `uvx nox`), so the reader
uses the standard library only; and a JSON Schema validator names no nearest key. Each contract
exports its JSON Schema (`json_schema`, for editors and check-jsonschema) and a reference table
(`reference`, for the docs), and the unit tests check every bundled file against both readers.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError, load_toml


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

# A rule over a table's keys (the table's own keys already checked): (key or "", problem) each.
Rule = Callable[[Mapping[str, Any]], Iterable[tuple[str, str]]]
# One more test of a value: a problem phrase, or None.
Check = Callable[[Any], "str | None"]

_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "number": (int, float),
    "bool": (bool,),
    "list": (list,),
    "table": (dict,),
}
_SAID = {
    "str": "a string",
    "int": "an integer",
    "number": "a number",
    "bool": "true or false",
    "list": "a list",
    "table": "a table",
}
_JSON_TYPES = {
    "str": "string",
    "int": "integer",
    "number": "number",
    "bool": "boolean",
    "list": "array",
    "table": "object",
}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class Spec:
    """One value of a contract. A table lists its keys (`fields`), or takes named entries each
    of one kind (`values`, names matching `names`), or neither: an open table whose keys belong
    to someone else (vLLM's engine arguments, a model config), where only its being a table is
    checked."""

    type: str  # str, int, number, bool, list, table
    doc: str = ""
    required: bool = False
    default: Any = MISSING
    minimum: float | None = None  # >=
    above: float | None = None  # >
    maximum: float | None = None  # <=
    choices: tuple[Any, ...] | None = None
    pattern: str | None = None  # a string must match it whole
    pattern_says: str = ""  # what the pattern asks, in words
    nonempty: bool = False  # a string not blank, a list or table not empty
    unique: bool = False  # a list's items distinct
    unique_by: str | None = None  # a list of tables: this key distinct across them
    items: Spec | None = None  # a list's items
    fields: Mapping[str, Spec] | None = None  # a table's keys; any other is unknown
    values: Spec | None = None  # a table of named entries: each entry
    names: str | None = None  # the pattern of those entries' names
    names_say: str = ""
    check: Check | None = None
    check_says: str = ""  # what `check` asks, in words (docs and JSON Schema)
    rules: tuple[Rule, ...] = ()
    rules_say: tuple[str, ...] = ()  # what the rules ask, in words

    def __post_init__(self) -> None:
        if self.type not in _PYTHON_TYPES:
            raise ValueError(f"unknown type {self.type!r}")


def table(
    fields: Mapping[str, Spec],
    doc: str = "",
    required: bool = False,
    rules: tuple[Rule, ...] = (),
    rules_say: tuple[str, ...] = (),
) -> Spec:
    """A table with these keys and no others."""
    return Spec("table", doc, required, fields=fields, rules=rules, rules_say=rules_say)


def entries(values: Spec, doc: str = "", **extra: Any) -> Spec:
    """A table of named entries, each a `values`."""
    return Spec("table", doc, values=values, **extra)


def open_table(doc: str = "", required: bool = False) -> Spec:
    """A table whose keys belong to someone else: only its being a table is checked."""
    return Spec("table", doc, required)


def strings(doc: str = "", item: Spec | None = None, **extra: Any) -> Spec:
    """A list of non-empty strings (each also an `item`, where given)."""
    return Spec("list", doc, items=item or Spec("str", nonempty=True), **extra)


@dataclass(frozen=True)
class Problem:
    """One departure from a contract: where (`cells.e2e-cpu.gpus`, `failure #2.test`; "" for
    the file itself) and what."""

    where: str
    text: str

    def line(self, path: Path | str) -> str:
        return f"{path}: {self.where}: {self.text}" if self.where else f"{path}: {self.text}"


def nearest(name: str, known: Iterable[str]) -> str:
    """`; did you mean 'x'?` for the closest of `known`, else the known names in brackets."""
    choices = sorted(str(k) for k in known)
    close = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f" (known: {', '.join(choices) or 'none'})"


def problems(data: Any, spec: Spec, where: str = "") -> list[Problem]:
    """Every way `data` departs from `spec`, in the file's order."""
    found: list[Problem] = []
    _check(data, spec, where, found)
    return found


def raise_for(path: Path | str, found: list[Problem]) -> None:
    """One UserError holding a line per problem; nothing when there are none."""
    if found:
        raise UserError("\n".join(problem.line(path) for problem in found))


def read(path: Path, spec: Spec, what: str) -> dict[str, Any]:
    """The TOML file at `path` (`what` names it in errors: "matrix file"), checked against
    `spec`, with the defaults the contract declares filled in; or a UserError."""
    data = load_toml(path, what)
    raise_for(path, problems(data, spec))
    return with_defaults(data, spec)


def with_defaults(data: dict[str, Any], spec: Spec) -> dict[str, Any]:
    """`data` (checked) with each absent key that has a default set to it, in every table
    present, entries and lists of tables too."""
    if spec.fields is not None:
        for key, sub in spec.fields.items():
            if key not in data and sub.default is not MISSING:
                data[key] = _copy(sub.default)
            elif key in data:
                _defaults_below(data[key], sub)
    elif spec.values is not None:
        for value in data.values():
            _defaults_below(value, spec.values)
    return data


def _defaults_below(value: Any, spec: Spec) -> None:
    if spec.type == "table" and isinstance(value, dict):
        with_defaults(value, spec)
    elif spec.type == "list" and spec.items is not None and isinstance(value, list):
        for item in value:
            _defaults_below(item, spec.items)


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value)) if isinstance(value, (dict, list)) else value


# --- checking --------------------------------------------------------------------------------


def _is(value: Any, type_name: str) -> bool:
    if isinstance(value, bool) and type_name != "bool":
        return False  # TOML's true is no number
    return isinstance(value, _PYTHON_TYPES[type_name])


def _said(value: Any) -> str:
    """What a value is, in words, with the value where it is short."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    for type_name in ("int", "str", "list", "table"):
        if _is(value, type_name):
            kind = _SAID[type_name]
            break
    else:
        kind = "a float" if isinstance(value, float) else f"a {type(value).__name__}"
    shown = repr(value)
    return f"{kind} ({shown})" if len(shown) <= 40 and not isinstance(value, dict) else kind


def _key(where: str, key: str) -> str:
    shown = key if _BARE_KEY.fullmatch(key) else json.dumps(key)
    return f"{where}.{shown}" if where else shown


def _item(where: str, index: int, value: Any) -> str:
    """A list's item: `failure #2` (counted from 1, as people count entries), or by its name
    where a table has one: `mutant 'block-hash-drops-last-token'`."""
    if isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"]:
        return f"{where} {value['name']!r}"
    return f"{where} #{index}"


def _check(value: Any, spec: Spec, where: str, found: list[Problem]) -> None:
    if not _is(value, spec.type):
        found.append(Problem(where, f"must be {_SAID[spec.type]}, not {_said(value)}"))
        return
    before = len(found)
    if spec.type == "table":
        _check_table(value, spec, where, found)
    elif spec.type == "list":
        _check_list(value, spec, where, found)
    else:
        _check_scalar(value, spec, where, found)
    if len(found) == before and spec.check is not None:
        problem = spec.check(value)
        if problem:
            found.append(Problem(where, problem))


def _check_scalar(value: Any, spec: Spec, where: str, found: list[Problem]) -> None:
    if isinstance(value, str):
        if spec.nonempty and not value.strip():
            found.append(Problem(where, "must not be empty"))
            return
        if spec.pattern is not None and not re.fullmatch(spec.pattern, value):
            says = spec.pattern_says or f"match {spec.pattern}"
            found.append(Problem(where, f"{value!r}: must be {says}"))
            return
    if spec.choices is not None and value not in spec.choices:
        shown = ", ".join(str(c) for c in spec.choices)
        hint = nearest(value, spec.choices) if isinstance(value, str) else ""
        hint = hint if hint.startswith(";") else ""
        found.append(Problem(where, f"{value!r} is not one of {shown}{hint}"))
    bounds = (
        (spec.minimum, ">=", lambda v, b: v >= b),
        (spec.above, ">", lambda v, b: v > b),
        (spec.maximum, "<=", lambda v, b: v <= b),
    )
    for bound, relation, holds in bounds:
        if bound is not None and not holds(value, bound):
            found.append(Problem(where, f"must be {relation} {bound:g}, not {value!r}"))


def _check_list(value: list[Any], spec: Spec, where: str, found: list[Problem]) -> None:
    if spec.nonempty and not value:
        found.append(Problem(where, "must not be empty"))
    if spec.items is not None:
        for index, item in enumerate(value, start=1):
            _check(item, spec.items, _item(where, index, item), found)
    if spec.unique:
        seen: list[Any] = []
        for item in value:
            if item in seen:
                found.append(Problem(where, f"{item!r} is listed twice"))
            seen.append(item)
    if spec.unique_by is not None:
        names = [i.get(spec.unique_by) for i in value if isinstance(i, dict)]
        for name in sorted({n for n in names if names.count(n) > 1 and n is not None}, key=str):
            found.append(Problem(where, f"{spec.unique_by} {name!r} is defined twice"))


def _check_table(value: dict[str, Any], spec: Spec, where: str, found: list[Problem]) -> None:
    before = len(found)
    if spec.nonempty and not value:
        found.append(Problem(where, "must not be empty"))
    if spec.fields is not None:
        for key, item in value.items():
            sub = spec.fields.get(key)
            if sub is None:
                found.append(Problem(_key(where, key), "unknown key" + nearest(key, spec.fields)))
            else:
                _check(item, sub, _key(where, key), found)
        for key, sub in spec.fields.items():
            if sub.required and key not in value:
                what = "a required table" if sub.type == "table" else "required"
                found.append(Problem(_key(where, key), f"missing ({what})"))
    elif spec.values is not None:
        for key, item in value.items():
            if spec.names is not None and not re.fullmatch(spec.names, key):
                says = spec.names_say or f"match {spec.names}"
                found.append(Problem(_key(where, key), f"the name must be {says}"))
                continue
            _check(item, spec.values, _key(where, key), found)
    if len(found) == before:  # the rules read keys already checked
        for rule in spec.rules:
            for key, text in rule(value):  # a key, a dotted path below the table, or ""
                found.append(Problem(".".join(part for part in (where, key) if part), text))


# --- what a contract says, for people and tools ------------------------------------------------


def json_schema(spec: Spec, title: str = "") -> dict[str, Any]:
    """The contract as a JSON Schema (draft 2020-12) of the parsed TOML: for editors (taplo,
    Even Better TOML) and check-jsonschema. What only a `check` or a rule can say is in the
    descriptions; the reader here checks it."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **_schema(spec)}
    if title:
        schema["title"] = title
    return schema


def _schema(spec: Spec) -> dict[str, Any]:
    out: dict[str, Any] = {"type": _JSON_TYPES[spec.type]}
    said = [spec.doc, spec.check_says, *spec.rules_say]
    if any(said):
        out["description"] = " ".join(s for s in said if s)
    if spec.default is not MISSING:
        out["default"] = spec.default
    if spec.choices is not None:
        out["enum"] = list(spec.choices)
    for bound, name in (
        (spec.minimum, "minimum"),
        (spec.above, "exclusiveMinimum"),
        (spec.maximum, "maximum"),
    ):
        if bound is not None:
            out[name] = bound
    if spec.type == "str":
        if spec.pattern is not None:
            out["pattern"] = f"^(?:{spec.pattern})$"
        elif spec.nonempty:
            out["pattern"] = r"\S"
    if spec.type == "list":
        if spec.nonempty:
            out["minItems"] = 1
        if spec.unique:
            out["uniqueItems"] = True
        if spec.items is not None:
            out["items"] = _schema(spec.items)
    if spec.type == "table":
        if spec.nonempty:
            out["minProperties"] = 1
        if spec.fields is not None:
            out["properties"] = {key: _schema(sub) for key, sub in spec.fields.items()}
            required = [key for key, sub in spec.fields.items() if sub.required]
            if required:
                out["required"] = required
            out["additionalProperties"] = False
        elif spec.values is not None:
            out["additionalProperties"] = _schema(spec.values)
            if spec.names is not None:
                out["propertyNames"] = {"pattern": f"^(?:{spec.names})$"}
    return out


@dataclass(frozen=True)
class Row:
    """One key of a contract as the reference lists it."""

    key: str  # dotted: cells.NAME.gpus, failure[].test
    type: str
    required: bool
    default: str
    allowed: str  # its range, choices or pattern, in words
    doc: str
    notes: tuple[str, ...] = field(default=())


def reference(spec: Spec, where: str = "") -> list[Row]:
    """Every key of the contract, depth first, in the order it declares them."""
    rows: list[Row] = []
    if spec.fields is not None:
        for key, sub in spec.fields.items():
            rows += _rows(_key(where, key), sub)
    elif spec.values is not None:
        rows += _rows(_key(where, "NAME"), spec.values)
    return rows


def _rows(key: str, spec: Spec) -> list[Row]:
    allowed = []
    if spec.choices is not None:
        allowed.append("one of " + ", ".join(str(c) for c in spec.choices))
    for bound, relation in ((spec.minimum, ">="), (spec.above, ">"), (spec.maximum, "<=")):
        if bound is not None:
            allowed.append(f"{relation} {bound:g}")
    if spec.pattern is not None:
        allowed.append(spec.pattern_says or spec.pattern)
    if spec.nonempty:
        allowed.append("not empty")
    if spec.unique:
        allowed.append("no repeats")
    if spec.unique_by:
        allowed.append(f"{spec.unique_by} unique")
    if spec.check_says:
        allowed.append(spec.check_says)
    type_name = spec.type
    if spec.type == "list" and spec.items is not None:
        type_name = f"list of {spec.items.type}" if spec.items.type != "table" else "tables"
    default = "" if spec.default is MISSING else json.dumps(spec.default)
    row = Row(key, type_name, spec.required, default, "; ".join(allowed), spec.doc, spec.rules_say)
    rows = [row]
    if spec.type == "table":
        rows += reference(spec, key)
    elif spec.type == "list" and spec.items is not None and spec.items.type == "table":
        rows += reference(spec.items, f"{key}[]")
    return rows


def markdown(spec: Spec, where: str = "") -> str:
    """The reference as a Markdown table: key, type, default, allowed values, meaning."""
    lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for row in reference(spec, where):
        key = f"`{row.key}`" + (" (required)" if row.required else "")
        default = f"`{row.default}`" if row.default else ""
        meaning = " ".join([row.doc, *row.notes]).replace("|", "\\|")
        allowed = row.allowed.replace("|", "\\|")
        lines.append(f"| {key} | {row.type} | {default} | {allowed} | {meaning} |")
    return "\n".join(lines) + "\n"
