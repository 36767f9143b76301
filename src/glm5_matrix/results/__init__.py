"""Per-cell results: the recorder inside the cell and its pytest plugin (recorder), the
results.json contract both sides read (schema), and what the runner side writes from outside
pytest (closing: endings, skips, commands, the summary line; junit: junit.xml of a run that
ended early)."""
