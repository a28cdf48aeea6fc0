"""The real-release tier: real vLLM CPU servers of each release 0.19-0.32.

Runs only when selected (``pytest -m real_releases``, ``make real-releases``);
a plain ``pytest`` skips it. Each release runs from its own environment
(``scripts/real_release_env.sh``, cached under ``.cache/real-releases``).
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if "real_releases" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="real-release tier: make real-releases")
    for item in items:
        if "real_releases" in item.keywords:
            item.add_marker(skip)
