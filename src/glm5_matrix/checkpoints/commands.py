"""The `prune` and `verify` subcommands (registered by glm5_matrix.cli)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from glm5_matrix.checkpoints.manifest import MANIFEST_NAME
from glm5_matrix.checkpoints.plan import (
    MODEL_CARD_NAME,
    PROVENANCE_NAME,
    describe_plan,
    format_size,
    plan_prune,
)
from glm5_matrix.checkpoints.reading import open_checkpoint
from glm5_matrix.checkpoints.verify import verify_checkpoint
from glm5_matrix.checkpoints.writer import check_destination, execute_prune
from glm5_matrix.errors import UserError

DEFAULT_LAYERS = 4

_PRUNE_HELP = f"""\
Build a layer-pruned GLM-5.3-Flash checkpoint: decoder layers 0..N-1 and the MTP layer(s),
renumbered to follow them (45 -> N), every width unchanged. Tensor bytes are copied verbatim;
config.json, the safetensors index, a model card ({MODEL_CARD_NAME}), the derivation
({PROVENANCE_NAME}) and a sha256 manifest ({MANIFEST_NAME}) are written; tokenizer and other
side files are copied unchanged. SRC is never modified; DST appears only when complete.

Refused (exit 2, one line): N outside 1..num_hidden_layers; an N that keeps no DSA/MLA layer
(layers 0-2 of GLM-5.3-Flash are all KDA, so N >= 4), because the pruned model would lack the
full model's MLA/indexer KV cache groups; an N whose last layer has a dense MLP while the MTP
layer is MoE (vLLM builds the MTP MLP like the last layer's).
"""


def register(subparsers: Any) -> None:
    prune = subparsers.add_parser(
        "prune",
        help="build a layer-pruned GLM-5.3-Flash checkpoint",
        description=_PRUNE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prune.add_argument(
        "src", metavar="SRC", type=Path, help="full GLM-5.3-Flash checkpoint directory"
    )
    prune.add_argument("dst", metavar="DST", type=Path, help="directory to create")
    prune.add_argument(
        "--layers", type=int, default=DEFAULT_LAYERS, metavar="N",
        help=f"decoder layers to keep (default {DEFAULT_LAYERS})",
    )  # fmt: skip
    prune.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    prune.add_argument("--force", action="store_true", help="replace an existing DST")
    prune.add_argument(
        "--source-revision", metavar="REV",
        help="source revision for the model card (default: read from a HF cache snapshot path)",
    )  # fmt: skip
    prune.set_defaults(func=run_prune)

    verify = subparsers.add_parser(
        "verify",
        help="check a GLM-5.3-Flash checkpoint directory",
        description="Check config, index against shard headers, per-layer tensors and the "
        "manifest hashes (when present); print the layer types and the KV cache groups vLLM "
        "should build. Exit 1 when a check fails.",
    )
    verify.add_argument("directory", metavar="DIR", type=Path)
    verify.set_defaults(func=run_verify)


def run_prune(args: argparse.Namespace) -> int:
    src: Path = args.src
    if not src.is_dir():
        if src.exists():
            raise UserError(f"{src}: SRC is a file, not a checkpoint directory")
        raise UserError(f"{src}: SRC directory not found")
    plan = plan_prune(open_checkpoint(src), args.layers, args.source_revision)
    if args.dry_run:
        check_destination(src, args.dst, args.force)
        print("\n".join(["dry run: nothing written", *describe_plan(plan)]))
        return 0
    execute_prune(plan, args.dst, args.force)
    print(
        f"{args.dst}: {plan.layers} layers + MTP, {len(plan.kept)} tensors, "
        f"{format_size(plan.output_bytes())}"
    )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    report = verify_checkpoint(args.directory)
    print("\n".join(report.lines))
    for problem in report.problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    if report.problems:
        print(f"{args.directory}: {len(report.problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{args.directory}: OK")
    return 0
