"""Reproductions of the vLLM defects the matrix found, for vLLM's maintainers (upstream/ at the
repository's root), and `nox -s upstream`, which runs the CPU ones against the `cpu`
environment's vLLM and says which still reproduce."""
