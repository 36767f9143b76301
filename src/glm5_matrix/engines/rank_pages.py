"""How the pd suite reads P's and D's pages when P and D run at other TP sizes (issue 36).

With P and D at one TP size both are read as they are (rank 0: the CPU cells run TP1). With one
side at TP1 and the other at TP `tp`, each page is read once per rank of the TP `tp` side and
keyed by rank (glm5_matrix.verdicts.tp_split.rank_key): there, every rank's own page; on the TP1
side, inside its worker, the part of its page that rank holds (glm5_matrix.engines.workers.
rank_part, the split from the model's config, glm5_matrix.verdicts.tp_split). The same digest
comparisons then say whether the ranks' pages are the TP1 pages split per rank, byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from glm5_matrix.engines.engine_configs import pd_role_tp
from glm5_matrix.errors import UserError
from glm5_matrix.matrix.context import CellContext
from glm5_matrix.verdicts import tp_split, transfers

Read = tuple[str, int]  # (layer, block id)


@dataclass(frozen=True)
class PageView:
    """tp = 1: pages as they are, rank 0 of either server. tp > 1 (the role `unsplit` at TP1,
    the other at tp): per rank, keyed by rank; `splits` says what part of the TP1 page each rank
    holds ({layer: split})."""

    tp: int = 1
    splits: Mapping[str, tp_split.Split] = field(default_factory=dict)
    unsplit: str = "prefill"

    def read(
        self,
        server: Any,
        role: str,
        keys: Sequence[transfers.PageKey],
        reads: Sequence[Read],
        splits: Mapping[str, tp_split.Split] | None = None,
    ) -> dict[transfers.PageKey, tuple[str, ...]]:
        """The digests of `reads` on `server` (a servers.VllmServer in `role`), keyed by `keys`
        (per rank where tp > 1). `splits` replaces the view's (a control's split) on the TP1
        side."""
        if self.tp == 1:
            return transfers.keyed_reads(
                keys, server.worker_rpc("glm5_page_digests", json.dumps(list(reads)))[0]
            )
        out: dict[transfers.PageKey, tuple[str, ...]] = {}
        if role != self.unsplit:
            ranks = server.worker_rpc("glm5_page_digests", json.dumps(list(reads)))
            if len(ranks) != self.tp:
                raise AssertionError(f"{len(ranks)} ranks of the {role} answered at TP{self.tp}")
            for rank, digests in enumerate(ranks):
                out.update(_keyed(rank, keys, digests))
            return out
        chosen = self.splits if splits is None else splits
        for rank in range(self.tp):
            request = {
                "reads": [[layer, block, chosen[layer]] for layer, block in reads],
                "rank": rank,
                "tp": self.tp,
            }
            (digests,) = server.worker_rpc("glm5_rank_part_digests", json.dumps(request))
            out.update(_keyed(rank, keys, digests))
        return out


# P and D at one TP size: pages as they are.
SAME_TP = PageView()


def _keyed(
    rank: int, keys: Sequence[transfers.PageKey], digests: Sequence[Sequence[str]]
) -> dict[transfers.PageKey, tuple[str, ...]]:
    ranked = [(g, p, tp_split.rank_key(rank, layer)) for g, p, layer in keys]
    return transfers.keyed_reads(ranked, digests)


def page_view(
    cell: CellContext,
    model_config: Mapping[str, Any],
    group_layers: Sequence[Sequence[str]],
    mamba_groups: Sequence[int],
) -> PageView:
    """The view of a pd cell: plain where P and D run one TP size; per rank where one of them
    runs TP1 and the other more (neither at TP1 is not handled)."""
    prefill, decode = pd_role_tp(cell, "prefill"), pd_role_tp(cell, "decode")
    if prefill == decode:
        return PageView()
    if 1 not in (prefill, decode):
        raise UserError(f"cell {cell.id}: P at TP{prefill}, D at TP{decode}: one side must be TP1")
    tp = max(prefill, decode)
    splits = tp_split.layer_splits(model_config, group_layers, mamba_groups, tp)
    return PageView(tp, splits, "prefill" if prefill == 1 else "decode")
