"""What the cells are, as data: the matrix (matrix.toml), the profiles, the cell context the
suites read, what each cell guards in vLLM, and the known failures of vLLM versions."""
