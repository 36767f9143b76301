"""The matrix report: its data model (model), the files it writes (markdown, junit, page: report.html),
the headless-Chromium check of the page (browser), the `glm5-matrix report` command (command),
and the CI pipelines generated from the matrix (pipelines, pipeline_checks)."""
