"""The kernel cache the engines compile into, its archive (export, import) and the guard that
fails a start that compiled."""
