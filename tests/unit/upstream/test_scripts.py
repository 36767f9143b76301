"""The reproductions as a maintainer gets them (upstream/NAME/repro.py and ISSUE.md): each script
imports vLLM and the standard library only, the parts every script carries are the same in
each, each draft embeds its script as it is, leads with a short snippet and carries the
environment block; and the machinery the scripts share (the supervisor, the verdict, the exit
status) does what their docstrings say, shown on stand-in subjects that need no vLLM."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from scaffold import ROOT

from glm5_matrix.errors import UserError
from glm5_matrix.upstream import drafts, findings, outcome

SCRIPTS = sorted((ROOT / findings.FOLDER).glob("*/repro.py"))
ALLOWED = set(sys.stdlib_module_names) | {"vllm", "__future__"}
SHARED = re.compile(r"(?ms)^# --- shared: (\w+) .*?^# --- end shared: \1 ---$")
SNIPPET = re.compile(r"(?ms)\A# \[Bug\]: [^\n]+\n\n```(?:python|bash)\n(.*?)^```$")


def foreign_imports(source: str) -> list[str]:
    """Top-level names of the modules `source` imports that are neither vLLM nor the standard
    library (imports inside functions count too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if not node.level else ["<relative import>"]
        else:
            continue
        found += [n for n in names if n.split(".")[0] not in ALLOWED]
    return found


def shared_blocks(source: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in SHARED.finditer(source)}


def drift(texts: dict[str, str]) -> list[str]:
    """Shared blocks that differ between scripts: `NAME in FILE` for each copy unlike the
    first file's."""
    canonical: dict[str, tuple[str, str]] = {}
    problems = []
    for path, text in sorted(texts.items()):
        for name, block in shared_blocks(text).items():
            first = canonical.setdefault(name, (path, block))
            if block != first[1]:
                problems.append(f"{name} in {path} differs from {first[0]}'s")
    return problems


# --- what the scripts are ----------------------------------------------------------------------


def test_there_is_a_script_per_finding() -> None:
    assert [p.parent.name for p in SCRIPTS] == sorted(f.name for f in findings.load_findings(ROOT))
    assert not (ROOT / findings.FOLDER / "subject.py").exists()  # nothing beside them to copy


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
def test_a_script_imports_vllm_and_the_standard_library_only(script: Path) -> None:
    assert foreign_imports(script.read_text()) == []
    assert "glm5_matrix" not in script.read_text()


def test_a_foreign_import_is_caught() -> None:
    source = "import json\nimport subject\nfrom glm5_matrix import x\ndef f():\n    import torch\n"
    assert foreign_imports(source) == ["subject", "glm5_matrix", "torch"]
    assert foreign_imports("from . import subject\nfrom vllm import LLM\n") == ["<relative import>"]


def test_the_shared_blocks_are_the_same_in_every_script() -> None:
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in SCRIPTS}
    assert drift(texts) == []
    assert all("common" in shared_blocks(t) for t in texts.values())
    servers = [p for p, t in texts.items() if "servers" in shared_blocks(t)]
    assert len(servers) == 3, servers  # the three NIXL reproductions


def test_a_drifted_copy_is_caught() -> None:
    block = "# --- shared: common (x) ---\nA = 1\n# --- end shared: common ---"
    texts = {"a.py": block, "b.py": block.replace("A = 1", "A = 2")}
    assert drift(texts) == ["common in b.py differs from a.py's"]


# --- the drafts --------------------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
def test_a_draft_embeds_its_script_as_it_is(script: Path) -> None:
    draft = drafts.draft_path(script.parent)
    assert drafts.embedded(draft.read_text()) == [script.read_text()], (
        f"{draft}: its repro.py has drifted (python -m glm5_matrix.upstream.drafts)"
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
def test_a_draft_has_the_template_s_parts(script: Path) -> None:
    folder = script.parent
    if (folder / "COMMENT.md").exists():  # a comment on an open pull request, not an issue
        text = (folder / "COMMENT.md").read_text()
        assert "vllm-project/vllm#56416" in text or "pull/56416" in text
    else:
        text = (folder / "ISSUE.md").read_text()
        snippet = SNIPPET.match(text)
        assert snippet, "an ISSUE.md leads with its title and a code snippet"
        assert len(snippet.group(1).splitlines()) <= 20
    for part in ("python -m vllm.collect_env", "### Expected", "### Actual", "vllm-project/vllm#"):
        assert part in text, f"{folder.name}: no {part!r}"
    block = text.split("python -m vllm.collect_env", 1)[1]
    if "PENDING: the `python -m vllm.collect_env` block" in text:  # a GPU run not made yet
        (finding,) = [f for f in findings.load_findings(ROOT) if f.folder == folder]
        assert finding.platform == "gpu", "only a GPU draft may wait for its environment block"
    else:
        assert "vLLM Version" in block and "PyTorch version" in block, "real collect_env output"


def test_a_draft_s_script_is_put_in_its_block_and_nowhere_else() -> None:
    text = (
        "# t\n<details>\n<summary><code>repro.py</code> (x)</summary>\n\n```python\nprint(1)\n```\n"
    )
    assert drafts.embedded(text) == ["print(1)\n"]
    again = drafts.embed(text, "print(2)\n")
    assert drafts.embedded(again) == ["print(2)\n"] and again.startswith("# t\n<details>")
    for bad in ("no block", text + text):
        with pytest.raises(UserError, match="expected one"):
            drafts.embed(bad, "x\n")


def test_the_drafts_tool_says_which_drifted() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "glm5_matrix.upstream.drafts", "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- the machinery they share, on stand-in subjects --------------------------------------------


def _script(tmp_path: Path, subject: str) -> Path:
    """A script made of the shared common block and `subject` (no vLLM needed)."""
    source = (ROOT / findings.FOLDER / "llm-repr-after-engine-death" / "repro.py").read_text()
    imports = source[source.index("import argparse") : source.index("# --- shared: common")]
    path = tmp_path / "stand_in.py"
    path.write_text(
        "from __future__ import annotations\n\n"
        + imports
        + shared_blocks(source)["common"]
        + "\n\n\n"
        + textwrap.dedent(subject)
        + textwrap.dedent(
            """

            if __name__ == "__main__":
                if "--subject" in sys.argv:
                    sys.exit(run_subject())
                sys.exit(supervise([], float(sys.argv[1])))
            """
        )
    )
    return path


def _run(path: Path, timeout: float = 30.0) -> tuple[int, str, outcome.Verdict | None]:
    done = subprocess.run(
        [sys.executable, str(path), str(timeout)], capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout, outcome.parse_verdict(done.stdout)


@pytest.mark.parametrize(("reproduced", "status"), [(True, 1), (False, 0)])
def test_the_exit_status_and_lines_say_the_verdict(
    tmp_path: Path, reproduced: bool, status: int
) -> None:
    path = _script(
        tmp_path,
        f"""
        def run_subject() -> int:
            print("vLLM would log here")
            return verdict({reproduced}, "E happens", "A happened", "d")
        """,
    )
    code, out, found = _run(path)
    assert code == status == outcome.EXIT_STATUS[reproduced]
    assert out.splitlines()[:2] == ["expected: E happens", "actual:   A happened"]
    assert found is not None and found.reproduced is reproduced
    assert found.expected == "E happens" and found.actual == "A happened" and found.vllm
    assert "vLLM would log here" not in out  # the subject's output goes to stderr


def test_a_process_left_behind_is_no_check_and_is_stopped(tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    path = _script(
        tmp_path,
        f"""
        def run_subject() -> int:
            child = subprocess.Popen(["sleep", "600"], start_new_session=True)
            open({str(marker)!r}, "w").write(str(child.pid))
            return verdict(True, "e", "a")
        """,
    )
    code, _, found = _run(path)
    assert code == 2 and found is not None and found.reproduced is None
    assert "were left when the subject ended" in found.detail
    pid = int(marker.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_the_subject_s_temporary_files_are_removed(tmp_path: Path) -> None:
    marker = tmp_path / "folder"
    path = _script(
        tmp_path,
        f"""
        def run_subject() -> int:
            folder = tiny_model(weights=True)
            open({str(marker)!r}, "w").write(folder)
            return verdict(False, "e", "a")
        """,
    )
    code, _, _ = _run(path)
    folder = Path(marker.read_text())
    assert code == 0 and folder.name.startswith("vllm-repro-model-")
    assert not folder.exists() and not folder.parent.exists()  # the supervisor's whole scratch


def test_a_subject_past_the_bound_is_no_check(tmp_path: Path) -> None:
    path = _script(
        tmp_path,
        """
        def run_subject() -> int:
            time.sleep(600)
            return verdict(True, "e", "a")
        """,
    )
    code, _, found = _run(path, timeout=2.0)
    assert code == 2 and found is not None and found.reproduced is None
    assert "ran past --timeout 2 s" in found.detail


def test_a_subject_without_a_verdict_is_no_check(tmp_path: Path) -> None:
    path = _script(tmp_path, "def run_subject() -> int:\n    raise RuntimeError('boom')\n")
    code, _, found = _run(path)
    assert code == 2 and found is not None and "gave no verdict" in found.detail


def test_the_tiny_model_s_weights_load_with_safetensors(tmp_path: Path) -> None:
    """The random weights the scripts write with the standard library are a safetensors file
    that safetensors itself reads: every tensor vLLM's Llama loader asks for, float32, the
    fan-in scaled spread the docstring gives (the dummy loader's would be 1e-3)."""
    from safetensors.numpy import load_file

    path = _script(tmp_path, "def run_subject() -> int:\n    return 0\n")
    code = f"import runpy; print(runpy.run_path({str(path)!r})['tiny_model'](weights=True))"
    environ = {**os.environ, "TMPDIR": str(tmp_path)}  # the folder is the test's to remove
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ)
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.strip())
    assert folder.parent == tmp_path
    tensors = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    assert len(tensors) == 3 + 9 * config["num_hidden_layers"]
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype.name == "float32" and q.shape == (128, 128)
    assert 0.07 < float(q.std()) < 0.11  # 1 / sqrt(128) = 0.088
    assert float(tensors["model.norm.weight"].min()) == 1.0


# A process holding shared memory, as vLLM's engine core and workers do: its multiprocessing
# resource tracker (its child) unlinks the segment once the holder is gone.
HOLDER = (
    "from multiprocessing import shared_memory; import time\n"
    "m = shared_memory.SharedMemory(create=True, size=4096)\n"
    "print(m.name, flush=True); time.sleep(600)\n"
)


def _holder_subject(marker: Path, stop: str) -> str:
    return f"""
        def run_subject() -> int:
            holder = subprocess.Popen([sys.executable, "-c", {HOLDER!r}], stdout=subprocess.PIPE)
            open({str(marker)!r}, "w").write(holder.stdout.readline().decode().strip())
            {stop}
            return verdict(False, "e", "a")
        """


def test_kill_tree_leaves_the_resource_tracker_to_unlink_the_shared_memory(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "name"
    code, _, found = _run(_script(tmp_path, _holder_subject(marker, "kill_tree()")))
    assert code == 0 and found is not None and found.reproduced is False, found
    assert not (Path("/dev/shm") / marker.read_text()).exists()


def test_a_killed_resource_tracker_leaves_the_shared_memory_behind(tmp_path: Path) -> None:
    """Why kill_tree spares the tracker: SIGKILLed with the rest, it unlinks nothing."""
    marker = tmp_path / "name"
    stop = (
        "for pid in reversed(descendants(os.getpid())):\n"
        "                os.kill(pid, signal.SIGKILL)"
    )
    code, _, _ = _run(_script(tmp_path, _holder_subject(marker, stop)))
    left = Path("/dev/shm") / marker.read_text()
    try:
        assert code == 0 and left.exists()
    finally:
        left.unlink(missing_ok=True)


def _servers_block() -> dict[str, Any]:
    """The NIXL scripts' shared `servers` block, run with the imports it needs."""
    source = (ROOT / findings.FOLDER / "nixl-block-size-one-way" / "repro.py").read_text()
    imports = source[source.index("import argparse") : source.index("# --- shared: common")]
    namespace: dict[str, Any] = {}
    exec(imports + shared_blocks(source)["servers"], namespace)
    return namespace


@pytest.mark.parametrize("whole_group", [True, False], ids=["as-is", "leader-only"])
def test_stop_servers_waits_for_the_server_s_whole_process_group(
    tmp_path: Path, whole_group: bool
) -> None:
    """A server's group outlives the server: vLLM's processes, and the resource tracker that
    unlinks their shared memory once they are gone. stop_servers waits for all of it before its
    SIGKILL; waiting for the server alone (the planted defect) kills the rest mid-cleanup."""
    servers = _servers_block()
    cleaned = tmp_path / "left-by-the-group"
    cleaned.write_text("")
    # The leader ends on SIGTERM; a member of its group takes 1 s to clean up on it.
    member = f"trap 'sleep 1; rm {cleaned}; exit' TERM; while :; do sleep 0.1; done"
    server = subprocess.Popen(
        ["bash", "-c", f"bash -c {shlex.quote(member)} & exec sleep 600"], start_new_session=True
    )
    _until_group(servers["group"], server.pid, size=3)  # the member has set its trap
    if not whole_group:
        servers["group"] = lambda pgid: []  # the old loop: the server's own exit only
    servers["stop_servers"]([server], grace=20.0)
    assert cleaned.exists() is not whole_group
    assert _group_now(server.pid) == []


def _until_group(group: Any, pgid: int, size: int) -> None:
    for _ in range(100):
        if len(group(pgid)) >= size:
            return
        time.sleep(0.05)
    raise AssertionError(f"process group {pgid} never had {size} processes")


def _group_now(pgid: int) -> list[int]:
    """What is left of group `pgid` once a SIGKILL sent to it has had 5 s to land (killpg
    returns before its processes are gone; on a loaded box /proc shows them a while)."""
    group = _servers_block()["group"]
    for _ in range(100):
        if not group(pgid):
            break
        time.sleep(0.05)
    return group(pgid)
