"""Mutants: realistic regressions planted in a copy of a cell's vLLM, to show what the matrix
catches (`nox -s mutants`). The catalogue is data (mutants/catalogue.toml, patches in
mutants/patches/); catalogue reads it, patching builds the patched copy of an environment,
verdicts judges a run (pure), record writes results.json and report.md, run drives it all."""
