"""glm5-matrix: the test matrix for GLM-5.3-Flash on vLLM.

Data flows one way: matrix.toml -> noxfile (one session per cell) -> an isolated uv
environment (envs/ + constraints/) -> the pytest suites in tests/suites, which read the
cell's context -> per-cell results -> reports.
"""

__version__ = "0.1.0"
