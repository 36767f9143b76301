"""glm5_matrix.verdicts.divergence: where two traces of one request part."""

from __future__ import annotations

import pytest

from glm5_matrix.verdicts.divergence import first_divergence, plant_site


def _call(module: str, call: int, inputs: str, output: str, leaf: bool = True) -> dict:
    return {
        "module": module,
        "call": call,
        "class": "Linear" if leaf else "Block",
        "leaf": leaf,
        "inputs": inputs,
        "output": output,
    }


TRACE = [
    _call("model.layers.0.norm", 0, "i0", "o0"),
    _call("model.layers.0.proj", 0, "o0", "o1"),
    _call("model.layers.0", 0, "i0", "o1", leaf=False),
    _call("model.layers.1.norm", 0, "o1", "o2"),
    _call("model.layers.1.proj", 0, "o2", "o3"),
    _call("model.layers.1", 0, "o1", "o3", leaf=False),
]


def _with(trace: list[dict], index: int, **changed: str) -> list[dict]:
    return [dict(r, **changed) if i == index else dict(r) for i, r in enumerate(trace)]


def test_equal_traces_do_not_part():
    assert first_divergence(TRACE, [dict(r) for r in TRACE]) is None


def test_the_first_differing_output_is_named_with_its_inputs():
    # layers.1.proj gives other bytes for the same inputs; everything after it follows.
    other = _with(_with(TRACE, 4, output="x3"), 5, output="x3")
    found = first_divergence(TRACE, other)
    assert found is not None
    assert (found.index, found.module, found.call) == (4, "model.layers.1.proj", 0)
    assert found.inputs_equal and found.leaf and found.later_differing == 1
    assert "model.layers.1.proj" in found.describe() and "same inputs" in found.describe()


def test_a_difference_in_inputs_only_is_not_a_divergence_of_outputs():
    # Inputs that differ (a digest of arguments the model ignores) with equal outputs.
    assert first_divergence(TRACE, _with(TRACE, 1, inputs="zz")) is None
    found = first_divergence(TRACE, _with(TRACE, 1, inputs="zz", output="zz"))
    assert found is not None and found.index == 1 and not found.inputs_equal


def test_traces_of_other_calls_are_refused():
    with pytest.raises(ValueError, match="other calls"):
        first_divergence(TRACE, TRACE[:-1])
    with pytest.raises(ValueError, match="first other at 2"):
        first_divergence(TRACE, _with(TRACE, 2, module="model.layers.9"))


def test_plant_site_is_the_first_leaf_with_a_tensor_output_under_the_name():
    assert plant_site(TRACE, "layers.1.") == ("model.layers.1.norm", 0)
    no_output = _with(TRACE, 3, output="")
    assert plant_site(no_output, "layers.1.") == ("model.layers.1.proj", 0)
    with pytest.raises(ValueError, match=r"layers.7."):
        plant_site(TRACE, "layers.7.")
