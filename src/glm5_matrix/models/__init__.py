"""Models the harness makes itself: random weights (a vLLM load format), the tiny hybrid, the
synthesized drafters."""
