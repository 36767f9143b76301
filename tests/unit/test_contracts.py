"""glm5_matrix.contracts, the one reader of the TOML data files: the nearest name for a typo,
every problem a line, defaults, rules over several keys; and each of the six contracts as JSON
Schema agrees with the reader on every bundled file and on planted defects (jsonschema, which
check-jsonschema brings into the harness environment)."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from glm5_matrix import contracts
from glm5_matrix.contracts import Spec
from glm5_matrix.envs.environments import ENV
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root
from glm5_matrix.matrix.known_failures import REGISTRY
from glm5_matrix.matrix.matrix import MATRIX
from glm5_matrix.matrix.profile_schema import PROFILE
from glm5_matrix.matrix.profiles import load_profile, profile_names
from glm5_matrix.mutants.catalogue import CATALOGUE
from glm5_matrix.upstream.findings import FINDING

ROOT = repo_root()


def _no_two(raw: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    if raw.get("a") == raw.get("b"):
        yield "b", "must differ from a"


SMALL = contracts.table(
    {
        "name": Spec("str", required=True, pattern=r"[a-z]+", pattern_says="lower-case letters"),
        "count": Spec("int", default=1, minimum=1, maximum=9),
        "ratio": Spec("number", above=0),
        "kind": Spec("str", choices=("alpha", "beta")),
        "flags": contracts.strings(unique=True),
        "items": Spec(
            "list", items=contracts.table({"a": Spec("int"), "b": Spec("int")}, rules=(_no_two,))
        ),
        "named": contracts.entries(Spec("bool"), names=r"[a-z]+", names_say="lower-case"),
        "free": contracts.open_table(),
    }
)


def _lines(data: dict[str, Any]) -> list[str]:
    return [p.line("f.toml") for p in contracts.problems(data, SMALL)]


def test_a_typo_gets_the_nearest_name_and_a_stranger_the_known_ones() -> None:
    assert _lines({"name": "x", "cuont": 2}) == [
        "f.toml: cuont: unknown key; did you mean 'count'?"
    ]
    assert _lines({"name": "x", "zzz": 2}) == [
        "f.toml: zzz: unknown key (known: count, flags, free, items, kind, name, named, ratio)"
    ]
    assert contracts.nearest("tiny-hybird-cpu", ["tiny-hybrid-cpu", "glm"]) == (
        "; did you mean 'tiny-hybrid-cpu'?"
    )


def test_every_problem_is_a_line_naming_table_and_key() -> None:
    data = {
        "count": 0,
        "ratio": 0,
        "kind": "alhpa",
        "flags": ["a", "a", ""],
        "items": [{"a": 1, "b": 1}, {"a": "1"}],
        "named": {"ok": True, "Bad": True, "no": 1},
        "free": {"anything": [1]},
    }
    assert _lines(data) == [
        "f.toml: count: must be >= 1, not 0",
        "f.toml: ratio: must be > 0, not 0",
        "f.toml: kind: 'alhpa' is not one of alpha, beta; did you mean 'alpha'?",
        "f.toml: flags #3: must not be empty",
        "f.toml: flags: 'a' is listed twice",
        "f.toml: items #1.b: must differ from a",
        "f.toml: items #2.a: must be an integer, not a string ('1')",
        "f.toml: named.Bad: the name must be lower-case",
        "f.toml: named.no: must be true or false, not an integer (1)",
        "f.toml: name: missing (required)",
    ]
    assert _lines({"name": "X1"}) == ["f.toml: name: 'X1': must be lower-case letters"]
    assert _lines({"name": "x", "count": True}) == [
        "f.toml: count: must be an integer, not a boolean (true)"  # TOML's true is no number
    ]


def test_read_fills_the_defaults_and_raises_one_error_for_all(tmp_path: Path) -> None:
    path = tmp_path / "f.toml"
    path.write_text('name = "x"\n[[items]]\na = 1\nb = 2\n')
    assert contracts.read(path, SMALL, "test file")["count"] == 1
    path.write_text('cuont = 2\nratio = "1"\n')
    with pytest.raises(UserError) as raised:
        contracts.read(path, SMALL, "test file")
    assert str(raised.value).splitlines() == [
        f"{path}: cuont: unknown key; did you mean 'count'?",
        f"{path}: ratio: must be a number, not a string ('1')",
        f"{path}: name: missing (required)",
    ]


@pytest.mark.parametrize("kind", ["missing", "folder", "binary", "not toml"])
def test_a_path_that_is_no_toml_file_is_one_line(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "f.toml"
    if kind == "folder":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00")
    elif kind == "not toml":
        path.write_text("[")
    with pytest.raises(UserError) as raised:
        contracts.read(path, SMALL, "test file")
    said = {
        "missing": "test file not found",
        "folder": "a folder, not a test file",
        "binary": "not a text file (a test file is UTF-8 TOML)",
        "not toml": "not valid TOML: ",
    }[kind]
    assert str(raised.value).startswith(f"{path}: {said}")
    assert "\n" not in str(raised.value)


# --- the six contracts, as JSON Schema, against the bundled files ------------------------------


def _bundled() -> Iterator[tuple[str, Spec, dict[str, Any]]]:
    yield "matrix.toml", MATRIX, tomllib.loads((ROOT / "matrix.toml").read_text())
    for name in profile_names():  # as loaded: a profile that extends another, merged
        yield f"profiles/{name}", PROFILE, load_profile(name).data
    for path in sorted((ROOT / "envs").glob("*.toml")):
        yield f"envs/{path.name}", ENV, tomllib.loads(path.read_text())
    yield "known-failures.toml", REGISTRY, tomllib.loads((ROOT / "known-failures.toml").read_text())
    catalogue = ROOT / "mutants" / "catalogue.toml"
    yield "mutants/catalogue.toml", CATALOGUE, tomllib.loads(catalogue.read_text())
    for path in sorted((ROOT / "upstream").glob("*/finding.toml")):
        yield str(path.relative_to(ROOT)), FINDING, tomllib.loads(path.read_text())


BUNDLED = list(_bundled())


def _schema_errors(data: Any, spec: Spec) -> list[str]:
    validator = jsonschema.Draft202012Validator(contracts.json_schema(spec))
    return [error.message for error in validator.iter_errors(data)]


@pytest.mark.parametrize(("name", "spec", "data"), BUNDLED, ids=[b[0] for b in BUNDLED])
def test_every_bundled_file_meets_its_contract_and_its_schema(
    name: str, spec: Spec, data: dict[str, Any]
) -> None:
    assert contracts.problems(data, spec) == []
    jsonschema.Draft202012Validator.check_schema(contracts.json_schema(spec))
    assert _schema_errors(data, spec) == []


def _first_table(data: dict[str, Any], spec: Spec) -> tuple[dict[str, Any], Spec]:
    """The first table of declared keys in `data`, depth first, with its spec."""
    if spec.fields is not None:
        return data, spec
    assert spec.values is not None
    key = next(iter(data))
    return _first_table(data[key], spec.values)


@pytest.mark.parametrize(("name", "spec", "data"), BUNDLED, ids=[b[0] for b in BUNDLED])
def test_the_reader_and_the_schema_refuse_the_same_plants(
    name: str, spec: Spec, data: dict[str, Any]
) -> None:
    """A typo and a wrong type planted in each file: both readers refuse each."""
    for plant in ("typo", "type"):
        planted = copy.deepcopy(data)
        assert spec.fields is not None
        key, sub = next(iter(spec.fields.items()))
        target, target_spec = planted, spec
        if sub.type == "table" and sub.values is not None:  # matrix.toml: into its first cell
            target, target_spec = _first_table(planted[key], sub)
        elif sub.type == "list" and sub.items is not None and sub.items.fields is not None:
            target, target_spec = planted[key][0], sub.items  # [[failure]], [[mutant]]
        assert target_spec.fields is not None
        present = next(k for k in target_spec.fields if k in target)
        if plant == "typo":
            target[present + "x"] = target.pop(present)
        else:
            target[present] = {"a": "table"} if target_spec.fields[present].type != "table" else 3
        assert contracts.problems(planted, spec), (name, plant)
        assert _schema_errors(planted, spec), (name, plant)


def test_the_reference_lists_every_key_with_type_default_and_range() -> None:
    rows = {row.key: row for row in contracts.reference(MATRIX)}
    gpus = rows["cells.NAME.gpus"]
    assert (gpus.type, gpus.default, gpus.allowed, gpus.required) == ("int", "0", ">= 0", False)
    assert rows["cells.NAME.suite"].required and "one of e2e" in rows["cells.NAME.suite"].allowed
    assert rows["cells.NAME.axis.values"].type == "list of str"
    power = {row.key: row for row in contracts.reference(PROFILE)}["pd.tolerances.min_power"]
    assert (power.type, power.allowed) == ("number", "> 1")
    failure = {row.key for row in contracts.reference(REGISTRY)}
    assert "failure[].fixed_in" in failure
    table = contracts.markdown(MATRIX)
    assert "| `cells.NAME.timeout_minutes` | int | `60` | >= 1 | what a CI step gets |" in table


def test_the_schema_holds_the_ranges_the_reader_checks() -> None:
    data = copy.deepcopy(load_profile("tiny-hybrid-cpu").data)
    data["pd"]["tolerances"]["min_power"] = 1.0
    data["tolerances"]["reference_repeats"] = 2
    assert [f"{p.where}: {p.text}" for p in contracts.problems(data, PROFILE)] == [
        "tolerances.reference_repeats: must be >= 4, not 2",
        "pd.tolerances.min_power: must be > 1, not 1.0",
    ]
    assert sorted(_schema_errors(data, PROFILE)) == [
        "1.0 is less than or equal to the minimum of 1",
        "2 is less than the minimum of 4",
    ]
