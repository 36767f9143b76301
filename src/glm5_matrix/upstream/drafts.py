"""The drafts for vLLM's tracker (upstream/NAME/ISSUE.md, or COMMENT.md for a comment on an open
pull request) carry their reproduction whole, in a collapsed block, so that what a maintainer
pastes is the file `nox -s upstream` runs:

    <details>
    <summary><code>repro.py</code> ...</summary>

    ```python
    (upstream/NAME/repro.py, byte for byte)
    ```

    </details>

`python -m glm5_matrix.upstream.drafts` puts each folder's repro.py into its draft's block
(--check: only says which drafts have drifted, exit 1 if any); tests/unit/upstream checks that
none has.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root
from glm5_matrix.upstream import findings

DRAFTS = ("ISSUE.md", "COMMENT.md")
_BLOCK = re.compile(
    r"(?ms)(^<summary><code>repro\.py</code>[^\n]*</summary>\n\n```python\n)(.*?)(^```$)"
)


def draft_path(folder: Path) -> Path:
    """The folder's draft: COMMENT.md where there is one (the finding has an open fix to
    comment on), else ISSUE.md."""
    comment = folder / "COMMENT.md"
    return comment if comment.is_file() else folder / "ISSUE.md"


def embedded(draft: str) -> list[str]:
    """The scripts a draft carries (one, in a well-formed draft)."""
    return [match.group(2) for match in _BLOCK.finditer(draft)]


def embed(draft: str, script: str, where: str = "draft") -> str:
    """`draft` with `script` in its repro.py block; a draft without exactly one block is an
    error."""
    if len(embedded(draft)) != 1:
        raise UserError(f"{where}: expected one <summary><code>repro.py</code> block")
    return _BLOCK.sub(lambda m: m.group(1) + script + m.group(3), draft)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm5_matrix.upstream.drafts")
    parser.add_argument("--check", action="store_true", help="only say which drafts drifted")
    args = parser.parse_args(argv)
    drifted = []
    try:
        for finding in findings.load_findings(repo_root()):
            path = draft_path(finding.folder)
            text = path.read_text()
            wanted = embed(text, finding.script_path.read_text(), str(path))
            if wanted != text:
                drifted.append(path)
                if not args.check:
                    path.write_text(wanted)
    except (UserError, OSError) as exc:
        print(f"glm5-matrix: error: {exc}", file=sys.stderr)
        return 2
    for path in drifted:
        print(f"{path}: {'drifted' if args.check else 'rewritten'}")
    return 1 if drifted and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
