"""glm5_matrix.verdicts.equivalence: the recursive comparison behind the metadata suite."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any

import pytest

from glm5_matrix.verdicts.equivalence import Difference, compare, describe, is_array_like


class FakeArray:
    """Duck-typed tensor: shape, dtype and tolist(), as torch.Tensor and numpy.ndarray have."""

    def __init__(self, values: list[Any], dtype: str = "int32") -> None:
        self.values = values
        self.dtype = dtype
        shape: list[int] = []
        level: Any = values
        while isinstance(level, list):
            shape.append(len(level))
            level = level[0] if level else None
        self.shape = tuple(shape)

    def tolist(self) -> list[Any]:
        return self.values

    def __eq__(self, other: object) -> bool:  # like a tensor, == is not a truth value
        raise RuntimeError("ambiguous truth value")


@dataclass
class Checkpoint:
    checkpoint_offsets: FakeArray
    state_indices: FakeArray
    offsets: list[int] | None = None


@dataclass
class Metadata:
    num_prefills: int
    checkpoint: Checkpoint | None = None
    spec_state_indices_tensor: FakeArray | None = None
    nums_dict: dict[Any, Any] | None = None


def _metadata(state_indices: list[int], offsets: list[int] | None = None) -> Metadata:
    return Metadata(
        num_prefills=2,
        checkpoint=Checkpoint(
            FakeArray([4352, 0]), FakeArray(state_indices), offsets=offsets or [4352, 0]
        ),
        spec_state_indices_tensor=FakeArray([[1, 2, 3], [4, 5, 6]]),
        nums_dict={64: {"nums": 3}},
    )


def _paths(differences: list[Difference]) -> list[str]:
    return [d.path for d in differences]


def test_equal_nested_objects_have_no_difference() -> None:
    assert compare(_metadata([7, -1]), _metadata([7, -1])) == []


def test_nested_dataclass_difference_names_the_field_path() -> None:
    differences = compare(_metadata([1007, -1]), _metadata([7, -1]))
    assert _paths(differences) == ["checkpoint.state_indices"]
    assert "expected 1007, got 7" in differences[0].message
    assert "[0]" in differences[0].message  # the position inside the tensor
    assert str(differences[0]).startswith("checkpoint.state_indices: ")


def test_every_differing_field_is_reported() -> None:
    left = _metadata([1, 2])
    right = dataclasses.replace(_metadata([1, 3]), num_prefills=3)
    assert _paths(compare(left, right)) == ["num_prefills", "checkpoint.state_indices"]


def test_fields_added_later_are_compared_without_naming_them() -> None:
    # A dataclass grown by a field the comparison was never told about.
    Grown = dataclasses.make_dataclass(
        "Grown", [("new_per_group_indices", Any, field(default=None))], bases=(Metadata,)
    )
    left = Grown(num_prefills=1, new_per_group_indices=FakeArray([1, 2]))
    right = Grown(num_prefills=1, new_per_group_indices=FakeArray([1, 9]))
    assert _paths(compare(left, right)) == ["new_per_group_indices"]


def test_none_versus_value() -> None:
    with_checkpoint = _metadata([5, 6])
    without = dataclasses.replace(with_checkpoint, checkpoint=None)
    differences = compare(with_checkpoint, without)
    assert _paths(differences) == ["checkpoint"]
    assert "got None" in differences[0].message
    assert _paths(compare(without, with_checkpoint)) == ["checkpoint"]


def test_lists_compare_by_length_and_element() -> None:
    assert _paths(compare([1, 2, 3], [1, 2])) == [""]
    assert "length differs" in compare([1, 2, 3], [1, 2])[0].message
    assert _paths(compare([1, [2, 3]], [1, [2, 4]])) == ["[1][1]"]
    left = _metadata([1, 2], offsets=[4352, 0])
    right = _metadata([1, 2], offsets=[4352, 16])
    assert _paths(compare(left, right)) == ["checkpoint.offsets[1]"]


def test_dicts_compare_keys_and_values() -> None:
    assert _paths(compare({"a": 1, "b": 2}, {"a": 1, "b": 3})) == ["['b']"]
    differences = compare({"a": 1}, {"a": 1, "c": 2})
    assert _paths(differences) == [""] and "extra ['c']" in differences[0].message
    left = _metadata([1, 2])
    right = dataclasses.replace(_metadata([1, 2]), nums_dict={64: {"nums": 4}})
    assert _paths(compare(left, right)) == ["nums_dict[64]['nums']"]


def test_namedtuple_fields_are_named() -> None:
    Pair = namedtuple("Pair", ["rows", "cols"])
    assert _paths(compare(Pair(FakeArray([1]), 2), Pair(FakeArray([1]), 3))) == ["cols"]


def test_arrays_compare_shape_dtype_and_values() -> None:
    shape = compare(FakeArray([1, 2, 3]), FakeArray([1, 2]))
    assert "shape differs: expected (3,), got (2,)" in shape[0].message
    dtype = compare(FakeArray([1, 2]), FakeArray([1, 2], dtype="int64"))
    assert "dtype differs: expected int32, got int64" in dtype[0].message
    values = compare(FakeArray([[1, 2], [3, 4]]), FakeArray([[1, 2], [3, 5]]))
    assert "values differ at 1 of 4 positions" in values[0].message
    assert "[1, 1]: expected 4, got 5" in values[0].message
    assert compare(FakeArray([[1, 2]]), FakeArray([[1, 2]])) == []


def test_nan_equals_nan_in_arrays_and_scalars() -> None:
    nan = float("nan")
    assert compare(FakeArray([1.0, nan], dtype="float32"), FakeArray([1.0, nan], "float32")) == []
    assert compare(nan, nan) == []


def test_array_versus_non_array() -> None:
    differences = compare(FakeArray([1]), [1])
    assert len(differences) == 1 and "FakeArray(shape=(1,)" in differences[0].message


def test_type_mismatch_is_a_difference() -> None:
    assert "type differs" in compare(1, True)[0].message
    assert "type differs" in compare((1, 2), [1, 2])[0].message


def test_unknown_types_compare_with_equality_and_say_so() -> None:
    class Opaque:
        def __init__(self, value: int) -> None:
            self.value = value

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Opaque) and other.value == self.value

    assert compare(Opaque(1), Opaque(1)) == []
    message = compare(Opaque(1), Opaque(2))[0].message
    assert "Opaque differs (compared with ==)" in message

    class NoTruth:
        def __eq__(self, other: object) -> object:
            return [True]

    assert "not a bool" in compare(NoTruth(), NoTruth())[0].message


def test_self_referencing_structures_terminate() -> None:
    @dataclass
    class Node:
        value: int
        children: list[Any] = field(default_factory=list)

    left, right = Node(1), Node(1)
    left.children.append(left)
    right.children.append(right)
    assert compare(left, right) == []


def test_describe_lists_one_difference_per_line() -> None:
    text = describe(compare({"a": 1, "b": 2}, {"a": 3, "b": 4}))
    assert text.splitlines() == [
        "['a']: int differs (compared with ==): expected 1, got 3",
        "['b']: int differs (compared with ==): expected 2, got 4",
    ]


def test_is_array_like() -> None:
    assert is_array_like(FakeArray([1]))
    assert not is_array_like([1]) and not is_array_like(FakeArray)


def test_numpy_arrays() -> None:
    np = pytest.importorskip("numpy", reason="numpy is not installed in this environment")
    assert compare(np.arange(4), np.arange(4)) == []
    differences = compare(np.arange(4).reshape(2, 2), np.array([[0, 1], [2, 9]]))
    assert _paths(differences) == [""] and "[1, 1]: expected 3, got 9" in differences[0].message


def test_torch_tensors_compare_by_value_not_layout() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    base = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    # A non-contiguous view with the same values equals a fresh contiguous tensor.
    assert compare(base.t().contiguous().t(), base.clone()) == []
    assert "dtype differs" in compare(base, base.to(torch.int64))[0].message
    changed = base.clone()
    changed[1, 2] = 100
    assert "[1, 2]: expected 5, got 100" in compare(base, changed)[0].message
