"""`glm5-matrix prune` and `glm5-matrix verify`: layer-pruned GLM-5.3-Flash checkpoints.

prune keeps decoder layers 0..N-1 and the MTP layer(s), renumbered to follow them (45 -> N),
and edits the config so vLLM builds exactly the full model's first N layers. Tensor bytes are
copied verbatim from the source shards; the result is built in a temporary directory next to
DST and renamed into place only when complete. verify checks a checkpoint directory.

One module per concern, each readable alone:

- config: read and check a GLM-5.3-Flash config; cut it to N layers (pruned_config)
- safetensors_header: read and write safetensors headers
- reading: a checkpoint directory, its index and shard headers checked against each other
- plan: what a prune keeps, renames, drops and writes, and the byte runs that copy it
  (plan_prune, describe_plan, copy_runs)
- copying: files from byte ranges, copied by the kernel and hashed behind the copy
- writer: carry a plan out, atomically (execute_prune)
- card: the model card and the provenance file
- manifest: SHA256SUMS
- verify: verify_checkpoint
- commands: the CLI subcommands (register)
"""

from glm5_matrix.checkpoints.card import model_card
from glm5_matrix.checkpoints.commands import DEFAULT_LAYERS, register, run_prune, run_verify
from glm5_matrix.checkpoints.config import (
    LINEAR_ATTENTION,
    ConfigEdit,
    load_glm_config,
    pruned_config,
)
from glm5_matrix.checkpoints.manifest import MANIFEST_NAME, format_manifest, read_manifest
from glm5_matrix.checkpoints.plan import (
    MODEL_CARD_NAME,
    PROVENANCE_NAME,
    CopyRun,
    KeptTensor,
    OutputShard,
    PrunePlan,
    copy_runs,
    describe_plan,
    plan_prune,
)
from glm5_matrix.checkpoints.reading import (
    INDEX_NAME,
    SINGLE_SHARD_NAME,
    Checkpoint,
    open_checkpoint,
    split_layer_key,
)
from glm5_matrix.checkpoints.safetensors_header import (
    ShardHeader,
    TensorEntry,
    encode_header,
    read_shard_header,
)
from glm5_matrix.checkpoints.verify import VerifyReport, verify_checkpoint
from glm5_matrix.checkpoints.writer import execute_prune

__all__ = [
    "DEFAULT_LAYERS",
    "INDEX_NAME",
    "LINEAR_ATTENTION",
    "MANIFEST_NAME",
    "MODEL_CARD_NAME",
    "PROVENANCE_NAME",
    "SINGLE_SHARD_NAME",
    "Checkpoint",
    "ConfigEdit",
    "CopyRun",
    "KeptTensor",
    "OutputShard",
    "PrunePlan",
    "ShardHeader",
    "TensorEntry",
    "VerifyReport",
    "copy_runs",
    "describe_plan",
    "encode_header",
    "execute_prune",
    "format_manifest",
    "load_glm_config",
    "model_card",
    "open_checkpoint",
    "plan_prune",
    "pruned_config",
    "read_manifest",
    "read_shard_header",
    "register",
    "run_prune",
    "run_verify",
    "split_layer_key",
    "verify_checkpoint",
]
