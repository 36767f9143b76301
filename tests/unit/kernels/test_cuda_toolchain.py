"""glm5_matrix.kernels.cuda_toolchain: the headers a CUDA toolkit assembled from NVIDIA's pip wheels
lacks, taken from the interpreter's nvidia packages."""

from __future__ import annotations

from pathlib import Path

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.kernels import cuda_toolchain


def test_toolkit_headers_come_from_the_interpreters_nvidia_packages(tmp_path: Path) -> None:
    cuda = tmp_path / "cuda"
    (cuda / "include").mkdir(parents=True)
    (cuda / "include" / "cuda_runtime.h").write_text("")
    lib = tmp_path / "site"
    nvidia = lib / "nvidia" / "cu13" / "include"
    nvidia.mkdir(parents=True)
    for header in cuda_toolchain.TOOLKIT_HEADERS:
        (nvidia / header).write_text("")
    flags, notes = cuda_toolchain.toolkit_headers(cuda, lib)
    assert flags == [f"-isystem {nvidia}"] and "cublasLt.h" in notes[0]
    for header in cuda_toolchain.TOOLKIT_HEADERS:  # a full toolkit: nothing added
        (cuda / "include" / header).write_text("")
    assert cuda_toolchain.toolkit_headers(cuda, lib) == ([], [])
    (cuda / "include" / "nvrtc.h").unlink()
    (nvidia / "nvrtc.h").unlink()
    with pytest.raises(UserError, match=r"lacks nvrtc\.h"):
        cuda_toolchain.toolkit_headers(cuda, lib)
