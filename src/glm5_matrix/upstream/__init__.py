"""Reproductions of the vLLM defects the matrix found, for vLLM's maintainers (upstream/ at the
repository's root: one self-contained script each, and its draft issue), and `nox -s upstream`,
which runs them as they are against one vLLM (the `cpu` environment's, another version, or a
given interpreter's) and says which still reproduce."""
