"""The CI pipelines generated from the matrix (generate: Buildkite and GitHub Actions, with
vLLM CI's step model) and their schema checks (checks). They read matrix data only."""
