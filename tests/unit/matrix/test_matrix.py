"""The matrix: the cells users type, their tags, selection by tag, and malformed files."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root
from glm5_matrix.matrix.matrix import load_matrix

ROOT = repo_root()
ENVS = {"cpu", "cuda", "harness"}

# The names users type (issue #2); they are a contract, so they are spelled out here.
GPU_VARIANTS = {
    "e2e-tp1(deep_gemm)",
    "e2e-tp1(flashinfer)",
    "e2e-tp1-graphs",
    "e2e-tp2(deep_gemm)",
    "e2e-tp2(flashinfer)",
    "e2e-tp4(deep_gemm)",
    "e2e-tp4(flashinfer)",
    "offload-tp1(simple)",
    "offload-tp1(offloading)",
    "dflash-tp1",
    "noise-tp1",
    "pd-nixl",
}
CPU_CELLS = {
    "e2e-cpu",
    "e2e-cpu-tp2",
    "e2e-cpu-tp4",
    "pd-nixl-cpu",
    "pd-nixl-cpu-tp1-tp2",
    "pd-nixl-cpu-tp2-tp1",
    "layout",
    "unit",
    "lint",
    "metadata",
    "faults",
}


def test_every_cell_users_type_is_there(matrix):
    ids = {variant.id for variant in matrix.variants}
    assert ids >= GPU_VARIANTS
    assert {cell.name for cell in matrix.cells} >= CPU_CELLS


@pytest.mark.parametrize(
    ("variant_id", "expected"),
    [
        ("e2e-tp1(deep_gemm)", {"gpu", "gpus-1", "sm90", "e2e", "moe-deep_gemm", "tp-1"}),
        ("e2e-tp2(flashinfer)", {"gpu", "gpus-2", "sm90", "e2e", "moe-flashinfer", "tp-2"}),
        ("e2e-tp4(deep_gemm)", {"gpu", "gpus-4", "sm90", "e2e", "moe-deep_gemm", "tp-4"}),
        ("offload-tp1(simple)", {"gpu", "gpus-1", "sm90", "offload", "kv-simple", "tp-1"}),
        ("offload-tp1(offloading)", {"gpu", "offload", "kv-offloading"}),
        ("pd-nixl", {"gpu", "gpus-2", "sm90", "pd"}),
        ("e2e-cpu", {"cpu", "e2e"}),
        ("e2e-cpu-tp2", {"cpu", "e2e", "tp-2", "env-cpu"}),
        ("e2e-cpu-tp4", {"cpu", "e2e", "tp-4", "env-cpu"}),
        ("pd-nixl-cpu", {"cpu", "pd"}),
        ("pd-nixl-cpu-tp1-tp2", {"cpu", "pd", "tp-2", "env-cpu"}),
        ("pd-nixl-cpu-tp2-tp1", {"cpu", "pd", "tp-2", "env-cpu"}),
        ("layout", {"cpu", "layout", "env-cuda"}),
        ("metadata", {"cpu", "metadata", "env-cuda"}),
        ("faults", {"cpu", "faults", "env-harness"}),
    ],
)
def test_tags(matrix, variant_id, expected):
    tags = set(matrix.variant(variant_id).tags)
    assert expected <= tags, f"{variant_id}: missing {expected - tags}"
    assert ("gpu" in tags) != ("cpu" in tags)


def test_gpu_cells_are_exactly_the_gpu_tagged_ones(matrix):
    assert {v.id for v in matrix.select("gpu")} == GPU_VARIANTS
    assert not {v.id for v in matrix.select("cpu")} & GPU_VARIANTS


def test_selection_by_tag(matrix):
    assert {v.id for v in matrix.select("moe-flashinfer")} == {
        "e2e-tp1(flashinfer)",
        "e2e-tp2(flashinfer)",
        "e2e-tp4(flashinfer)",
    }
    assert {v.id for v in matrix.select("gpus-2")} == {
        "e2e-tp2(deep_gemm)",
        "e2e-tp2(flashinfer)",
        "pd-nixl",
    }
    assert matrix.select("no-such-tag") == []


def test_axis_value_reaches_the_settings(matrix):
    assert matrix.variant("e2e-tp2(flashinfer)").settings["moe_backend"] == "flashinfer"
    assert matrix.variant("offload-tp1(simple)").settings["kv_connector"] == "simple"
    assert matrix.variant("offload-tp1-offloading").settings["kv_connector"] == "offloading"
    assert matrix.variant("layout").env == "cuda"


def test_pd_cells_carry_the_conv_state_layout(matrix):
    for name in ("pd-nixl", "pd-nixl-cpu"):
        assert matrix.cell(name).environment["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"


def test_unknown_cell_is_one_clear_error(matrix):
    with pytest.raises(UserError, match="unknown cell 'e2e-tp3'"):
        matrix.variant("e2e-tp3")


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "matrix.toml"
    path.write_text(textwrap.dedent(text))
    return path


GOOD_CELL = """
[cells.x]
description = "d"
suite = "e2e"
env = "cpu"
tests = ["tests/suites/test_e2e.py"]
"""


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s + "gpus = 'two'\n",
            r"cells\.x\.gpus: must be an integer, not a string \('two'\)$",
        ),
        (lambda s: s + "colour = 'red'\n", r"cells\.x\.colour: unknown key \(known: axis, "),
        (lambda s: s + "gpu = 1\n", r"cells\.x\.gpu: unknown key; did you mean 'gpus'\?$"),
        (lambda s: s.replace('suite = "e2e"', 'suite = "soak"'), r"cells\.x\.suite: 'soak' is not"),
        (lambda s: s.replace('suite = "e2e"', 'suite = "e2"'), r"did you mean 'e2e'\?$"),
        (lambda s: s.replace('env = "cpu"', 'env = "rocm"'), r"cells\.x\.env: 'rocm' has no envs/"),
        (
            lambda s: s.replace('env = "cpu"', 'env = "cpus"'),
            r"envs/cpus\.toml; did you mean 'cpu'",
        ),
        (lambda s: s.replace('env = "cpu"\n', ""), r"cells\.x\.env: missing \(or an axis"),
        (lambda s: s.replace('description = "d"\n', ""), r"cells\.x\.description: missing"),
        (lambda s: s + "tp = 2\ngpus = 1\n", r"cells\.x\.tp: 2 must be at most gpus \(1\)"),
        (lambda s: s + "tp = 0\n", r"cells\.x\.tp: must be >= 1, not 0"),
        (lambda s: s + "gpus = -1\n", r"cells\.x\.gpus: must be >= 0, not -1"),
        (lambda s: s + "min_compute_capability = '9'\ngpus = 1\n", r"min_compute_capability"),
        (lambda s: s + "min_compute_capability = '9.0'\n", r"set, but the cell needs no GPU"),
        (lambda s: s + "axis = { name = 'moe', values = [] , tag_prefix = 'm'}\n", r"axis\.values"),
        (lambda s: s + "axis = { name = 'moe', values = ['a'] }\n", r"axis\.tag_prefix: missing"),
        (lambda s: s + "axis = { name = 'm', values = ['a b'], tag_prefix = 'm' }\n", r"'a b'"),
        (lambda s: s + "commands = [['ruff']]\n", r"exactly one of tests or commands"),
        (lambda s: s + "[", r"not valid TOML"),
        (lambda s: s + "timeout_minutes = 0\n", r"cells\.x\.timeout_minutes: must be >= 1"),
        (lambda s: s + "timeout_minutes = '1h'\n", r"cells\.x\.timeout_minutes: must be an int"),
        (
            lambda s: s + "guards = ['csrc/moe/']\n",
            r"cells\.x\.guards #1: 'csrc/moe/' is not a vLLM",
        ),
        (lambda s: s + "guards = ['vllm/v1/**']\n", r"cells\.x\.guards #1: 'vllm/v1/\*\*'"),
        (lambda s: s + "guards = ['vllm/../etc/']\n", r"is not a vLLM source path"),
        (lambda s: s + "guards = ['vllm/a.py', 'vllm/a.py']\n", r"'vllm/a\.py' is listed twice"),
        (
            lambda s: s + "guard_sets = ['nope']\n",
            r"cells\.x\.guard_sets: no \[guard_sets\] 'nope'",
        ),
        (lambda s: s + "axis_guards.a = ['vllm/a.py']\n", r"axis_guards\.a: not an axis value"),
        (lambda s: s + "cores = [0, 0]\n", r"cells\.x\.cores: 0 is listed twice"),
        (lambda s: s + "cores = [-1]\n", r"cells\.x\.cores #1: must be >= 0, not -1"),
        (lambda s: s + "cores = ['0']\n", r"cells\.x\.cores #1: must be an integer, not a str"),
        (lambda s: s + "cores = 1\n", r"cells\.x\.cores: must be a list, not an integer \(1\)"),
        (lambda s: s + "reads = ['../x']\n", r"cells\.x\.reads #1: '\.\./x' is not a path inside"),
        (lambda s: s + "profile = 'tiny-hybrid'\n", r"profile: 'tiny-hybrid' has no profiles/"),
        (lambda s: s.replace("[cells.x]", "[cells.X]"), r"cells\.X: the name must be lower-case"),
        (
            lambda s: s + "[other]\n",
            r"matrix\.toml: other: unknown key \(known: cells, guard_sets\)",
        ),
    ],
)
def test_malformed_matrix_names_file_and_field(tmp_path, edit, message):
    path = _write(tmp_path, edit(GOOD_CELL))
    with pytest.raises(UserError, match=message) as info:
        load_matrix(path, known_envs=ENVS, known_profiles={"tiny-hybrid-cpu"})
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def test_every_problem_of_a_file_is_a_line_of_its_own(tmp_path):
    path = _write(tmp_path, GOOD_CELL + "gpu = 1\ntimeout_minutes = 0\n[cells.y]\nsuite = 'e2e'\n")
    with pytest.raises(UserError) as info:
        load_matrix(path, known_envs=ENVS)
    assert str(info.value).splitlines() == [
        f"{path}: cells.x.gpu: unknown key; did you mean 'gpus'?",
        f"{path}: cells.x.timeout_minutes: must be >= 1, not 0",
        f"{path}: cells.y.description: missing (required)",
    ]


def test_a_profile_misspelled_in_the_matrix_is_refused_at_load(tmp_path):
    """It passed `nox -l` and the plan before (issue 49): the runner's load names the profiles
    there are, so the typo is one line before any session is listed."""
    from glm5_matrix.matrix.profiles import profile_names
    from glm5_matrix.sessions import runner

    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "envs", root / "envs")
    shutil.copytree(ROOT / "profiles", root / "profiles")
    text = (ROOT / "matrix.toml").read_text()
    assert 'profile = "tiny-hybrid-cpu"' in text
    (root / "matrix.toml").write_text(
        text.replace('profile = "tiny-hybrid-cpu"', 'profile = "tiny-hybird-cpu"', 1)
    )
    with pytest.raises(UserError) as info:
        runner.load(root)
    (line,) = str(info.value).splitlines()
    assert line.endswith(
        "profile: 'tiny-hybird-cpu' has no profiles/tiny-hybird-cpu/profile.toml; did you mean "
        "'tiny-hybrid-cpu'?"
    )
    assert "tiny-hybrid-cpu" in profile_names()


@pytest.mark.parametrize("kind", ["folder", "binary"])
def test_a_matrix_path_that_is_no_text_file_is_one_line(tmp_path, kind):
    path = tmp_path / "matrix.toml"
    if kind == "folder":
        path.mkdir()
    else:
        path.write_bytes(bytes(range(256)))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(UserError) as info:
        load_matrix(path)
    said = {"folder": "a folder, not a matrix file", "binary": "not a text file"}[kind]
    assert str(info.value).startswith(f"{path}: {said}")
    assert "\n" not in str(info.value)
    assert sorted(tmp_path.rglob("*")) == before  # nothing created


def test_missing_matrix_file(tmp_path):
    with pytest.raises(UserError, match="matrix file not found"):
        load_matrix(tmp_path / "matrix.toml")


def test_adding_a_cell_is_a_data_edit(tmp_path):
    text = (ROOT / "matrix.toml").read_text() + textwrap.dedent(
        """
        [cells.e2e-tp8]
        description = "end-to-end at TP8"
        suite = "e2e"
        env = "cuda"
        tests = ["tests/suites/test_e2e.py"]
        profile = "glm-5.3-flash-4l"
        gpus = 8
        min_compute_capability = "9.0"
        tp = 8
        axis = { name = "moe_backend", values = ["deep_gemm"], tag_prefix = "moe" }
        """
    )
    matrix = load_matrix(_write(tmp_path, text), known_envs=ENVS)
    assert {"gpus-8", "tp-8", "moe-deep_gemm", "sm90"} <= set(
        matrix.variant("e2e-tp8(deep_gemm)").tags
    )


def test_timeouts_and_guards_come_from_the_data(matrix):
    assert matrix.cell("e2e-tp1").timeout_minutes == 90
    assert all(cell.timeout_minutes >= 1 for cell in matrix.cells)
    # The seed's lesson (#59536): the pruned-model cells guard the hybrid machinery too.
    e2e = matrix.variant("e2e-tp1(deep_gemm)").guards
    for path in (
        "vllm/models/glm5next/",
        "vllm/v1/attention/backends/gdn_attn.py",
        "vllm/model_executor/layers/mamba/",
        "vllm/v1/worker/gpu/",
        "vllm/v1/core/",
    ):
        assert path in e2e, path
    # An axis value adds its own: only the simple connector guards simple_kv_offload.
    assert "vllm/v1/simple_kv_offload/" in matrix.variant("offload-tp1(simple)").guards
    assert "vllm/v1/simple_kv_offload/" not in matrix.variant("offload-tp1(offloading)").guards
    assert matrix.variant("unit").guards == ()


def test_guard_sets_expand_in_order_without_repeats(tmp_path):
    text = textwrap.dedent(
        """
        [guard_sets]
        a = ["vllm/x/", "vllm/y.py"]
        b = ["vllm/y.py", "vllm/z.py"]

        [cells.x]
        description = "d"
        suite = "e2e"
        env = "cpu"
        tests = ["t"]
        guard_sets = ["a", "b"]
        guards = ["vllm/own.py"]
        axis = { name = "k", values = ["p", "q"], tag_prefix = "k" }
        axis_guards.q = ["vllm/q.py"]
        """
    )
    matrix = load_matrix(_write(tmp_path, text), known_envs=ENVS)
    assert matrix.cell("x").timeout_minutes == 60  # the default
    assert matrix.variant("x(p)").guards == ("vllm/x/", "vllm/y.py", "vllm/z.py", "vllm/own.py")
    assert matrix.variant("x(q)").guards[-1] == "vllm/q.py"


BIND = "VLLM_CPU_OMP_THREADS_BIND"


def _bound_cores(binding: str) -> set[int]:
    """The cores a VLLM_CPU_OMP_THREADS_BIND value names: ranks split by "|", each a list of
    cores and ranges ("0|1", "0-1", "0,2|1,3")."""
    cores: set[int] = set()
    for part in binding.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def _bindings(matrix, name: str) -> set[int]:
    """Every core the cell's engines are bound to: its environment, for a pd cell each server's
    environment as the suite builds it (engine_configs.pd_role_environment: the profile's [pd]
    tables and the cell's `*_environment` settings), and those of the cells it runs."""
    from glm5_matrix.engines import engine_configs
    from glm5_matrix.matrix.context import Weights, for_variant
    from glm5_matrix.matrix.profiles import load_profile

    cell = matrix.cell(name)
    tables = [cell.environment]
    if cell.suite == "pd" and cell.profile:
        variant = next(v for v in matrix.variants if v.cell.name == name)
        context = for_variant(variant, weights=Weights(kind="random"))
        profile = load_profile(cell.profile)
        tables += [
            engine_configs.pd_role_environment(profile, role, context)
            for role in engine_configs.PD_ROLES
        ]
    cores = {core for table in tables if BIND in table for core in _bound_cores(table[BIND])}
    for other in cell.runs:
        cores |= _bindings(matrix, other)
    return cores


def test_a_cells_cores_are_the_cores_its_engines_are_bound_to(matrix):
    """matrix.toml's `cores` (what a cell leases, so that two cells bound to one core take
    turns under -j) against the bindings the cell's engines get: none left out, none extra."""
    bound = {cell.name: _bindings(matrix, cell.name) for cell in matrix.cells}
    assert {name: sorted(c) for name, c in bound.items() if c} == {
        cell.name: list(cell.cores) for cell in matrix.cells if cell.cores
    }
    assert bound["pd-nixl-cpu-tp2-tp1"] == bound["pd-nixl-cpu-tp1-tp2"] == {0, 1}
    assert _bound_cores("0-1|2,3") == {0, 1, 2, 3}
