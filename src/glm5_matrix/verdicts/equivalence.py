"""Field-by-field comparison of two objects, naming the path of every difference.

Built for vLLM attention metadata (nested dataclasses holding tensors, lists and None), where
"equal" must mean equal in every field, including fields added after the comparison was
written: dataclasses are walked through `dataclasses.fields`, never a fixed list.

Tensors and arrays are recognised by duck typing (`shape`, `dtype`, `tolist`), so this module
imports neither torch nor numpy and compares them by shape, dtype and values; `tolist()` copies
a tensor to the host, so the device, strides and memory sharing of a tensor do not matter.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# How many differing positions of one tensor a message spells out.
_SHOWN_POSITIONS = 3


@dataclass(frozen=True)
class Difference:
    path: str  # e.g. "checkpoint.state_indices", "spec_query_start_loc", "[2].num_prefills"
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.message}"


def compare(expected: Any, actual: Any) -> list[Difference]:
    """Every difference between `expected` and `actual`, each with the path of its field."""
    differences: list[Difference] = []
    _compare(expected, actual, "", differences, set())
    return differences


def describe(differences: list[Difference]) -> str:
    """One line per difference, for an assertion message."""
    return "\n".join(str(d) for d in differences)


def is_array_like(value: Any) -> bool:
    """A tensor or array: has a shape, a dtype and a host copy through tolist()."""
    return (
        not isinstance(value, type)
        and hasattr(value, "shape")
        and hasattr(value, "dtype")
        and callable(getattr(value, "tolist", None))
    )


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _summary(value: Any) -> str:
    if is_array_like(value):
        return f"{type(value).__name__}(shape={tuple(value.shape)}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _compare(
    expected: Any, actual: Any, path: str, out: list[Difference], seen: set[tuple[int, int]]
) -> None:
    if expected is actual:
        return
    if expected is None or actual is None:
        out.append(Difference(path, f"expected {_summary(expected)}, got {_summary(actual)}"))
        return
    if is_array_like(expected) or is_array_like(actual):
        _compare_arrays(expected, actual, path, out)
        return
    if type(expected) is not type(actual):
        out.append(
            Difference(
                path,
                f"type differs: expected {type(expected).__qualname__}, "
                f"got {type(actual).__qualname__}",
            )
        )
        return
    # Containers and dataclasses may refer back to themselves; compare each pair once.
    key = (id(expected), id(actual))
    if key in seen:
        return
    seen.add(key)
    if dataclasses.is_dataclass(expected):
        for field in dataclasses.fields(expected):
            _compare(
                getattr(expected, field.name),
                getattr(actual, field.name),
                _join(path, field.name),
                out,
                seen,
            )
    elif isinstance(expected, tuple) and hasattr(expected, "_fields"):  # namedtuple
        for name, left, right in zip(expected._fields, expected, actual, strict=True):
            _compare(left, right, _join(path, name), out, seen)
    elif isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            out.append(
                Difference(path, f"length differs: expected {len(expected)}, got {len(actual)}")
            )
            return
        for index, (left, right) in enumerate(zip(expected, actual, strict=True)):
            _compare(left, right, f"{path}[{index}]", out, seen)
    elif isinstance(expected, Mapping):
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        if missing or extra:
            out.append(Difference(path, f"keys differ: missing {missing!r}, extra {extra!r}"))
        for name in expected:
            if name in actual:
                _compare(expected[name], actual[name], f"{path}[{name!r}]", out, seen)
    else:
        _compare_by_equality(expected, actual, path, out)


def _compare_by_equality(expected: Any, actual: Any, path: str, out: list[Difference]) -> None:
    if isinstance(expected, float) and math.isnan(expected) and math.isnan(actual):
        return
    try:
        equal = expected == actual
    except Exception as exc:  # an object whose == raises cannot be judged equal
        out.append(Difference(path, f"{type(expected).__qualname__} == raised {exc!r}"))
        return
    if not isinstance(equal, bool):
        out.append(
            Difference(
                path,
                f"{type(expected).__qualname__} == returned {type(equal).__qualname__}, "
                "not a bool: no rule to compare this type",
            )
        )
    elif not equal:
        out.append(
            Difference(
                path,
                f"{type(expected).__qualname__} differs (compared with ==): "
                f"expected {_summary(expected)}, got {_summary(actual)}",
            )
        )


def _compare_arrays(expected: Any, actual: Any, path: str, out: list[Difference]) -> None:
    if not (is_array_like(expected) and is_array_like(actual)):
        out.append(Difference(path, f"expected {_summary(expected)}, got {_summary(actual)}"))
        return
    if tuple(expected.shape) != tuple(actual.shape):
        out.append(
            Difference(
                path,
                f"shape differs: expected {tuple(expected.shape)}, got {tuple(actual.shape)}",
            )
        )
        return
    if str(expected.dtype) != str(actual.dtype):
        out.append(
            Difference(path, f"dtype differs: expected {expected.dtype}, got {actual.dtype}")
        )
        return
    left = _flatten(expected.tolist())
    right = _flatten(actual.tolist())
    positions = [
        i for i, (a, b) in enumerate(zip(left, right, strict=True)) if not _same_scalar(a, b)
    ]
    if positions:
        shape = tuple(expected.shape)
        shown = ", ".join(
            f"{_unravel(i, shape)}: expected {left[i]!r}, got {right[i]!r}"
            for i in positions[:_SHOWN_POSITIONS]
        )
        more = "" if len(positions) <= _SHOWN_POSITIONS else ", ..."
        out.append(
            Difference(
                path,
                f"values differ at {len(positions)} of {len(left)} positions "
                f"(shape {shape}): {shown}{more}",
            )
        )


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def _flatten(values: Any) -> list[Any]:
    if not isinstance(values, list):
        return [values]  # a 0-d tensor's tolist() is a scalar
    flat: list[Any] = []
    stack = [values]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            flat.append(item)
    return flat


def _unravel(flat_index: int, shape: tuple[int, ...]) -> list[int]:
    index: list[int] = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return list(reversed(index))
