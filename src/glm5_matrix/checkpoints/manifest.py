"""SHA256SUMS: the sha256 of every file of a pruned checkpoint, in sha256sum's format."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from glm5_matrix.errors import UserError

MANIFEST_NAME = "SHA256SUMS"


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def format_manifest(hashes: dict[str, str]) -> str:
    # sha256sum's format, so `sha256sum -c SHA256SUMS` checks it too.
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(hashes.items()))


def read_manifest(path: Path) -> dict[str, str]:
    hashes = {}
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a sha256sum file ({exc})") from None
    for number, line in enumerate(text.splitlines(), start=1):
        match = re.fullmatch(r"([0-9a-f]{64}) [ *](.+)", line)
        if match is None:
            raise UserError(f"{path}:{number}: not a sha256sum line")
        hashes[match[2]] = match[1]
    return hashes
