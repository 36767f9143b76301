"""The docs site's generated parts (tables rendered from the repository's data at build time)."""
