"""The real-server facts of each release, read from its source.

``compat/releases.py`` says, per series, whether vLLM asks the connector for
stats every step and how the stats cross to the API server;
``compat/servers.py`` whether prefix hashes agree across processes without
``PYTHONHASHSEED`` and whether MooncakeConnector takes
``bootstrap_server_address``. Each flag is checked here against the
release's own files (the overlays of ``scripts/fetch_vllm_releases.sh``), so
a wrong row fails by series and flag.
"""

from __future__ import annotations

import re

import pytest

from vllm_mooncake.compat.releases import LAYOUT_BY_SERIES, layout_of
from vllm_mooncake.compat.servers import server_facts
from vllm_mooncake.testing.overlays import RELEASES, overlay_dir, overlay_missing

KV = "vllm/distributed/kv_transfer/kv_connector/v1"


def _read(version: str, relative: str) -> str:
    return (overlay_dir(version) / relative).read_text()


def _source_flags(version: str) -> dict[str, bool]:
    scheduler = _read(version, "vllm/v1/core/sched/scheduler.py")
    mooncake = overlay_dir(version) / KV / "mooncake"
    connector_src = "".join(
        p.read_text() for p in mooncake.rglob("*.py") if "store" not in p.parts
    )
    return {
        # 0.19-0.23: `if kv_connector_stats and self.connector:` guards the ask.
        "stats_every_step": not re.search(
            r"if kv_connector_stats and self\.connector:", scheduler
        ),
        "stats_to_dict": "kv_connector_stats.to_dict()" in scheduler,
        "shared_hash_seed": "DEFAULT_NONE_HASH_SEED"
        in _read(version, "vllm/v1/core/kv_cache_utils.py"),
        "bootstrap_server_address": "bootstrap_server_address" in connector_src,
        "mooncake_store": "MooncakeStoreConnector"
        in _read(version, "vllm/distributed/kv_transfer/kv_connector/factory.py"),
    }


@pytest.mark.parametrize("version", RELEASES)
def test_server_flags_match_the_release_source(version: str) -> None:
    missing = overlay_missing(version)
    if missing is not None:
        pytest.skip(missing)
    layout, facts = layout_of(version), server_facts(version)
    declared = {
        "stats_every_step": layout.stats_every_step,
        "stats_to_dict": layout.stats_to_dict,
        "shared_hash_seed": facts.shared_hash_seed,
        "bootstrap_server_address": facts.bootstrap_server_address,
        "mooncake_store": facts.mooncake_store,
    }
    found = _source_flags(version)
    wrong = {flag: found[flag] for flag in declared if declared[flag] != found[flag]}
    assert not wrong, f"vLLM {version}: layout flags disagree with its source: {wrong}"


def test_layout_of_names_the_series_or_fails_by_name() -> None:
    assert layout_of("0.22.1") is LAYOUT_BY_SERIES["0.22"]
    assert layout_of("0.32.0+cpu") is LAYOUT_BY_SERIES["0.32"]
    with pytest.raises(ValueError, match=r"0\.18.*supported: 0\.19"):
        layout_of("0.18.0")
    with pytest.raises(ValueError, match=r"0\.35.*supported: 0\.19"):
        server_facts("0.35.0")
