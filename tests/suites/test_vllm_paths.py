"""The vLLM source paths the cells guard (matrix.toml: guard_sets, guards, axis_guards) exist in
the installed vLLM, so that `glm5-matrix affected` and the pipelines' change filters cannot rot
silently when vLLM moves a file. Runs in the `layout` cell (vLLM's CUDA build, whose package
tree is the repository's vllm/ folder)."""

from __future__ import annotations

from pathlib import Path

from glm5_matrix.files import repo_root
from glm5_matrix.matrix.matrix import MATRIX_FILE, load_matrix
from glm5_matrix.results.recorder import record_figure


def test_every_guarded_path_exists_in_the_installed_vllm() -> None:
    import vllm

    # vllm/__init__.py -> the folder holding vllm/: site-packages, or a source checkout's root.
    tree = Path(vllm.__file__).resolve().parent.parent
    matrix = load_matrix(repo_root() / MATRIX_FILE)
    guards = sorted({guard for variant in matrix.variants for guard in variant.guards})
    assert guards, "no cell guards any vLLM path"
    missing = [
        guard
        for guard in guards
        if not ((tree / guard).is_dir() if guard.endswith("/") else (tree / guard).is_file())
    ]
    record_figure("guards.paths_checked", len(guards), unit="paths")
    record_figure("guards.paths_missing", len(missing), limit=0, relation="==", unit="paths")
    assert not missing, (
        f"{len(missing)} of {len(guards)} guarded paths are not in vLLM {vllm.__version__} "
        f"({tree}): {missing}"
    )
