"""Models the harness makes itself: random weights (a vLLM load format), the tiny hybrid, the
synthesized drafters, and the KV-layout planner for a GLM-5.3-Flash config (layout)."""
