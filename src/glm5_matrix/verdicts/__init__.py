"""Judging what the engines did: greedy outputs against each other, equivalence, figures
against their limits, the KV layout planner and vLLM's own layout, page transfers. Pure
where they can be: data in, a verdict out."""
