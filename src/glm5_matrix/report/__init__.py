"""The matrix report: its data model (model), the files it writes (markdown, junit, page: report.html),
the headless-Chromium check of the page (browser), and the `glm5-matrix report`
command (command)."""
