"""Judging what the engines did: greedy outputs against each other, equivalence, figures
against their limits, vLLM's own KV layout against the planner's (models.layout), page
transfers. Pure where they can be: data in, a verdict out."""
