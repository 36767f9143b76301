"""DFlash2 drafters for the GLM target, with no download.

A DFlash2 drafter (vLLM's `DFlash2DraftModel`, models/qwen3_dflash2.py) reads the target's
hidden states at a few "taps" and concatenates them into its first projection, so its input is
len(taps) x hidden. The published drafter taps five boundaries of the 45-layer model; on the
4-layer checkpoint the taps must point at the embeddings and layers 0-3 instead. The taps are data
in the profile's [dflash] table, in DFlash's own convention: -1 is the embeddings, i the output of
layer i (vLLM adds 1 to get its aux-hidden-state ids, v1/worker/gpu/spec_decode/eagle/
eagle3_utils.py). vLLM does not check them: an id past the last layer is silently not captured
and the drafter fails later on a short input. Here it is one clear error up front.

Two drafters:
- the default, synthesized: a config.json whose widths match the target (hidden size, vocab) and
  the profile's [dflash.config], with random weights from the target's load format (vLLM loads
  the drafter with the target's load config); written once into the harness cache;
- a real one named by GLM5_DFLASH2_DRAFT: its taps are retargeted through a
  callable hf_overrides, which vLLM composes into the draft config (config/speculative.py,
  compose_draft_hf_overrides); on the target's own config it changes nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.cache import ensure_folder
from glm5_matrix.errors import UserError
from glm5_matrix.matrix.profiles import Profile
from glm5_matrix.models.glm_config import required, text_config

DRAFT_VARIABLE = "GLM5_DFLASH2_DRAFT"
DRAFT_ARCHITECTURE = "DFlash2DraftModel"
# Fields of the synthesized config that must come from the target, never from the profile.
_FROM_TARGET = ("hidden_size", "vocab_size")


@dataclass(frozen=True)
class Drafter:
    """The drafter of a DFlash cell and how it was chosen."""

    path: str
    taps: tuple[int, ...]  # DFlash convention: -1 embeddings, i the output of layer i
    num_speculative_tokens: int
    source: str  # "synthesized" or DRAFT_VARIABLE

    def speculative_config(self) -> dict[str, Any]:
        return {
            "method": "dflash",
            "model": self.path,
            "num_speculative_tokens": self.num_speculative_tokens,
        }

    def hf_overrides(self) -> Callable[[Any], Any]:
        """The engine's hf_overrides: retargets the drafter's taps, leaves the target alone.
        A partial of a module-level function, so vLLM can pickle it to its workers."""
        return functools.partial(retarget_taps, taps=self.taps)


def dflash_table(profile: Profile) -> dict[str, Any]:
    table = profile.section("dflash")
    if not table:
        raise UserError(f"profile {profile.name} has no [dflash] table")
    return table


def check_taps(taps: Any, target_layers: int, where: str) -> tuple[int, ...]:
    """The taps as a tuple, or a UserError: each is -1 (embeddings) .. target_layers - 1."""
    if (
        not isinstance(taps, list)
        or not taps
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in taps)
    ):
        raise UserError(f"{where}: target_layer_ids must be a non-empty list of integers")
    bad = [t for t in taps if not -1 <= t < target_layers]
    if bad:
        raise UserError(
            f"{where}: target_layer_ids {taps}: {bad} beyond the target's layers (it has "
            f"{target_layers}: -1 is the embeddings, 0..{target_layers - 1} the layer outputs)"
        )
    if len(set(taps)) != len(taps):
        raise UserError(f"{where}: target_layer_ids {taps} repeat a layer (vLLM would merge them)")
    return tuple(taps)


def retarget_taps(hf_config: Any, taps: Sequence[int]) -> Any:
    """hf_overrides body: point a DFlash drafter's taps at `taps`; other configs unchanged."""
    dflash = getattr(hf_config, "dflash_config", None)
    if not isinstance(dflash, dict):
        return hf_config
    hf_config.dflash_config = {**dflash, "target_layer_ids": list(taps)}
    # A top-level aux id list takes precedence in vLLM (already +1, its own convention).
    if getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) is not None:
        hf_config.eagle_aux_hidden_state_layer_ids = [t + 1 for t in taps]
    return hf_config


def synthesize_config(target_config: Mapping[str, Any], table: Mapping[str, Any]) -> dict[str, Any]:
    """The drafter's config.json: the profile's [dflash.config], the target's widths, the taps."""
    text = text_config(dict(target_config))
    target_layers = required(text, "num_hidden_layers")
    taps = check_taps(table.get("target_layer_ids"), target_layers, "[dflash]")
    own = dict(table.get("config") or {})
    clash = sorted(set(own) & set(_FROM_TARGET))
    if clash:
        raise UserError(f"[dflash.config]: {clash[0]!r} comes from the target, not the profile")
    if own.get("architectures") != [DRAFT_ARCHITECTURE]:
        raise UserError(f"[dflash.config]: architectures must be [{DRAFT_ARCHITECTURE!r}]")
    hidden, vocab = required(text, "hidden_size"), required(text, "vocab_size")
    extras = dict(own.pop("dflash_config", {}))
    group = int(extras.get("conv_group_size", 1))
    if hidden % group:
        raise UserError(f"[dflash.config]: conv_group_size {group} does not divide {hidden}")
    config = {
        **own,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "dflash_config": {
            **extras,
            "target_layer_ids": list(taps),
            # The mask token fills the draft positions; any id of the target's vocabulary.
            "mask_token_id": int(extras.get("mask_token_id", vocab - 1)),
        },
    }
    if not 0 <= config["dflash_config"]["mask_token_id"] < vocab:
        raise UserError(f"[dflash.config]: mask_token_id outside the target's vocab ({vocab})")
    return config


def ensure_synthesized(profile: Profile, cache_dir: Path) -> Path:
    """The synthesized drafter's folder (config.json only), written once into the cache."""
    config = synthesize_config(profile.config(), dflash_table(profile))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]

    def write(staging: Path) -> None:
        (staging / "config.json").write_text(text)

    return ensure_folder(cache_dir / f"dflash2-{profile.name}-{digest}", write, "config.json")


def resolve_drafter(
    profile: Profile,
    cache_dir: Path,
    environ: Mapping[str, str] | None = None,
) -> Drafter:
    """The cell's drafter: the one GLM5_DFLASH2_DRAFT names, else the synthesized one. A named
    drafter must exist and be a DFlash2 model reading as many taps as the profile retargets."""
    table = dflash_table(profile)
    taps = profile_taps(profile)
    tokens = int(table["num_speculative_tokens"])
    environ = os.environ if environ is None else environ
    named = environ.get(DRAFT_VARIABLE)
    if not named:
        path = ensure_synthesized(profile, cache_dir)
        return Drafter(str(path), taps, tokens, "synthesized")
    return Drafter(str(check_named_drafter(profile, named)), taps, tokens, DRAFT_VARIABLE)


def profile_taps(profile: Profile) -> tuple[int, ...]:
    """The taps the profile retargets a drafter to, checked against the target's layers."""
    target_layers = required(text_config(profile.config()), "num_hidden_layers")
    return check_taps(dflash_table(profile).get("target_layer_ids"), target_layers, "[dflash]")


def check_named_drafter(profile: Profile, named: str) -> Path:
    """The folder GLM5_DFLASH2_DRAFT names, resolved, or a UserError of one line: it must hold
    a DFlash2 drafter's config.json reading as many taps as the profile retargets. The runner
    calls this before any environment is built; it reads the config only."""
    taps = profile_taps(profile)
    source = DRAFT_VARIABLE
    config_path = Path(named).expanduser() / "config.json"
    if not config_path.is_file():
        raise UserError(f"{source}={named}: no DFlash2 drafter there (no config.json)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{config_path}: not valid JSON: {error}") from None
    if not isinstance(config, dict) or DRAFT_ARCHITECTURE not in (
        config.get("architectures") or []
    ):
        found = config.get("architectures") if isinstance(config, dict) else config
        raise UserError(f"{source}={named}: architectures {found} is not [{DRAFT_ARCHITECTURE!r}]")
    trained = (config.get("dflash_config") or {}).get("target_layer_ids")
    if isinstance(trained, list) and len(trained) != len(taps):
        raise UserError(
            f"{source}={named}: the drafter reads {len(trained)} taps {trained}, the profile "
            f"retargets {len(taps)} {list(taps)}"
        )
    return config_path.parent.resolve()
