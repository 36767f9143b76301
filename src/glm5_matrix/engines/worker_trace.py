"""Inside vLLM's worker processes: a trace of every module call, as digests of its inputs and
outputs, to find where two identical runs part (issue 27, the noise's source).

The same request twice on the same engine gives logits one or two bf16 steps apart on a GPU.
Which kernel makes them differ? A forward hook on every module of the model records, per call
in the order the calls complete (a module after the modules it calls), the module's name and
class, a sha256 of the bytes of its tensor inputs and one of its tensor outputs. Two traces of
the same request are compared by glm5_matrix.verdicts.divergence: the first call whose output differs
while everything before it was equal is where the noise starts.

The instrument has a control: `plant` names a module call whose output gets one bit flipped
(the lowest bit of its first byte: one unit in the last place of its first element). A trace
with it must part from a clean one exactly there.

Forward hooks fire in eager mode only (with torch.compile and CUDA graphs the model's modules
are not called one by one): the engine runs with enforce_eager. Nothing here changes what the
model computes, except the planted bit.
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Any

from glm5_matrix.engines.workers import model_of, raw_bytes

_STATE = "_glm5_trace"


def _tensors(value: Any) -> list[Any]:
    """The tensors in a hook's argument or output, in order (nested tuples, lists, dicts)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for key in value for t in _tensors(value[key])]
    return []


def tensors_digest(value: Any) -> str:
    """sha256 over the dtype, shape and raw bytes of each tensor in `value` ("" when none)."""
    tensors = _tensors(value)
    if not tensors:
        return ""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)};".encode())
        digest.update(raw_bytes(tensor))
    return digest.hexdigest()


def _flip_first_bit(output: Any) -> Any:
    """`output` with the lowest bit of the first floating tensor's first byte flipped (a copy;
    the module's own tensor is left alone)."""
    import torch

    if isinstance(output, torch.Tensor):
        if not output.is_floating_point() or output.numel() == 0:
            return output
        changed = output.detach().clone().contiguous()
        changed.reshape(-1).view(torch.uint8)[0] ^= 1
        return changed
    if isinstance(output, (list, tuple)):
        items = list(output)
        for i, item in enumerate(items):
            flipped = _flip_first_bit(item)
            if flipped is not item:
                items[i] = flipped
                return type(output)(items) if isinstance(output, tuple) else items
        return output
    return output


def _hook(
    state: dict[str, Any], name: str, module: Any, args: Any, kwargs: Any, output: Any
) -> Any:
    plant = state["plant"]
    planted = plant is not None and plant == [name, state["calls"].get(name, 0)]
    if planted:
        output = _flip_first_bit(output)
    state["calls"][name] = state["calls"].get(name, 0) + 1
    state["records"].append(
        {
            "module": name,
            "call": state["calls"][name] - 1,
            "class": type(module).__qualname__,
            "leaf": not any(True for _ in module.children()),
            "inputs": tensors_digest((args, kwargs)),
            "output": tensors_digest(output),
            "planted": planted,
        }
    )
    return output if planted else None


def worker_start_trace(worker: Any, plant: list[Any] | None = None) -> int:
    """Hook every module of the model; from now on each call is recorded. `plant` = [module
    name, call number]: that call's output gets one bit flipped. Returns the modules hooked."""
    worker_stop_trace(worker)
    model = model_of(worker)
    state: dict[str, Any] = {"records": [], "calls": {}, "handles": [], "plant": plant}
    for name, module in model.named_modules():
        handle = module.register_forward_hook(
            partial(_hook, state, name or "<model>"), with_kwargs=True
        )
        state["handles"].append(handle)
    setattr(worker, _STATE, state)
    return len(state["handles"])


def worker_stop_trace(worker: Any) -> list[dict[str, Any]]:
    """Remove the hooks; the records made since the trace started."""
    state = getattr(worker, _STATE, None)
    if state is None:
        return []
    for handle in state["handles"]:
        handle.remove()
    delattr(worker, _STATE)
    return list(state["records"])
