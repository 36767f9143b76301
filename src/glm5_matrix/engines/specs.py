"""The engine spec: what an in-process vLLM engine of a cell is built from. The model (the tiny
hybrid, a checkpoint, or the profile's config with glm5-random weights), the profile's [engine]
arguments, and the cell's settings (`cell_engine_args`: tensor parallelism, the MoE backend of
the matrix axis, the mode: eager, or compiled with CUDA graphs). vLLM is not imported here;
gpu_family asks torch."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.kernels import kernel_guard
from glm5_matrix.matrix.context import CellContext
from glm5_matrix.matrix.profiles import Profile, load_profile

# Engine args the harness decides itself; a profile that sets them is refused.
_HARNESS_ARGS = {"model", "tensor_parallel_size", "load_format"}


# The cell setting `mode`: what vLLM's enforce_eager is in each.
MODES = {"eager": True, "compiled": False}


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine is built from; equal specs can share one engine."""

    label: str
    model: str
    args: dict[str, Any]
    environment: dict[str, str] = field(default_factory=dict)


def engine_spec(cell: CellContext, profile: Profile | None = None, **overrides: Any) -> EngineSpec:
    """The engine of a cell: model + profile [engine] args + the cell's parallelism + overrides."""
    if profile is None:
        if cell.profile is None:
            raise UserError(f"cell {cell.id}: no profile, so no engine to build")
        profile = load_profile(cell.profile)
    engine = dict(profile.section("engine"))
    environment = {str(k): str(v) for k, v in engine.pop("environment", {}).items()}
    clash = _HARNESS_ARGS & set(engine)
    if clash:
        raise UserError(
            f"{profile.directory / 'profile.toml'} [engine]: {sorted(clash)[0]!r} is set by the "
            "harness (from the cell and the weights), not by the profile"
        )
    model, model_args = resolve_model(cell, profile)
    args = {**engine, **model_args, **cell_engine_args(cell, profile), **overrides}
    # The cell's environment (e.g. the conv-state layout) applies to its engines too.
    environment = {**cell.environment, **environment}
    label = f"{profile.name}:{cell.id}"
    if overrides:
        shown = (f"{k}={canonical(v)}" for k, v in sorted(overrides.items()))
        label += "[" + ",".join(shown) + "]"
    return EngineSpec(label=label, model=model, args=args, environment=environment)


def canonical(value: Any) -> Any:
    """A JSON-able form of engine arguments that is equal for equal configurations and the same
    in every process: callables by qualified name (functools.partial with its arguments; repr
    would show a memory address), dicts by sorted key, anything else by repr. Config keys
    (engine_configs.config_key) hash it; labels show it."""
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, functools.partial):
        return {
            "partial": canonical(value.func),
            "args": canonical(value.args),
            "keywords": canonical(value.keywords),
        }
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return repr(value)


def resolve_model(cell: CellContext, profile: Profile) -> tuple[str, dict[str, Any]]:
    """The model path and the load arguments it needs."""
    if cell.weights.kind == "checkpoint":
        assert cell.weights.path is not None
        return cell.weights.path, {}
    if "model" in profile.data:  # a generated model (the tiny hybrid)
        from glm5_matrix.models.tiny_hybrid import ensure_model

        return str(ensure_model(profile=profile.name)), {}
    # The profile's config.json with random weights: glm5-random (glm5_matrix.models.weights) unless
    # vLLM's plain dummy weights were asked for.
    if not profile.config_path.is_file():
        raise UserError(f"profile {profile.name}: no [model] table and no {profile.config_path}")
    from glm5_matrix.models.weights import LOAD_FORMAT

    load_format = "dummy" if cell.weights.kind == "dummy" else LOAD_FORMAT
    return str(profile.directory), {"load_format": load_format}


def cell_engine_args(cell: CellContext, profile: Profile | None = None) -> dict[str, Any]:
    """Engine args that come from the cell rather than the profile: TP, the MoE backend, and
    the mode (`eager`: enforce_eager; `compiled`: vLLM's default torch.compile and CUDA
    graphs, the mode users serve)."""
    args: dict[str, Any] = {}
    if cell.tp is not None and cell.tp > 1:
        args["tensor_parallel_size"] = cell.tp
    mode = cell.setting("mode")
    if mode is not None:
        if mode not in MODES:
            raise UserError(f"cell {cell.id}: mode {mode!r} is not one of {', '.join(MODES)}")
        args["enforce_eager"] = MODES[mode]
    backend = cell.setting("moe_backend")
    if backend is not None:
        if profile is None:
            raise UserError(f"cell {cell.id}: a MoE backend needs the profile's [moe_backends]")
        args["moe_backend"] = moe_backend_for(profile, backend, gpu_family())
    return args


def gpu_family() -> str:
    """`sm90`, `sm100`, ... of GPU 0 (the MoE backend and the KV dtype depend on it)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    major, _ = torch.cuda.get_device_capability(0)
    return f"sm{major}0"


def moe_backend_for(profile: Profile, axis_value: str, family: str) -> str:
    """The vLLM `moe_backend` that the matrix's backend axis value means on this GPU family."""
    table = profile.section("moe_backends").get(axis_value)
    if not isinstance(table, dict):
        raise UserError(f"profile {profile.name}: [moe_backends] has no {axis_value!r}")
    if family not in table:
        raise UserError(
            f"profile {profile.name}: [moe_backends].{axis_value} names no backend for {family} "
            f"(known: {', '.join(sorted(table))})"
        )
    return str(table[family])


def jit_monitor_args(spec: EngineSpec) -> dict[str, Any]:
    """vLLM's jit monitor in error mode when the kernel guard asks for it (see
    kernel_guard.jit_monitor_mode), unless the spec sets the mode itself."""
    if "jit_monitor_mode" in spec.args:
        return {}
    mode = kernel_guard.jit_monitor_mode(bool(spec.args.get("enforce_eager")))
    return {} if mode is None else {"jit_monitor_mode": mode}
