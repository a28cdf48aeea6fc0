"""Every private vLLM name we touch is still there, with the shape we use.

When a vLLM release renames or reshapes one, the test named after it fails.
"""

from __future__ import annotations

import pytest

from vllm_mooncake.compat.internals import (
    INTERNALS,
    Internal,
    applicable_internals,
    check_internal,
    missing_internals,
)
from vllm_mooncake.compat.releases import LAYOUT_BY_SERIES
from vllm_mooncake.compat.versions import (
    SUPPORTED_VLLM,
    UnsupportedVllmVersion,
    check_vllm_version,
    installed_vllm_version,
)


@pytest.mark.parametrize(
    "item",
    applicable_internals(),
    ids=lambda i: f"{i.owner.rsplit('.', 1)[1]}.{i.name}",
)
def test_internal_is_present(item: Internal) -> None:
    assert check_internal(item) is None


def test_a_changed_internal_is_reported_by_name() -> None:
    gone = Internal(INTERNALS[0].owner, "_no_such_queue", "attribute", "example")
    renamed = Internal(
        INTERNALS[0].owner,
        "_update_waiting_for_remote_kv",
        "method",
        "example",
        ("req",),
    )
    assert "_no_such_queue: attribute is no longer set" in (check_internal(gone) or "")
    assert "parameter(s) ['req'] are gone" in (check_internal(renamed) or "")


def test_installed_vllm_is_supported() -> None:
    assert check_vllm_version() in SUPPORTED_VLLM
    assert not missing_internals()
    assert installed_vllm_version()[:4] in SUPPORTED_VLLM


@pytest.mark.parametrize("version", ["0.18.1", "0.35.0", "1.0.0"])
def test_unsupported_versions_fail_with_the_supported_list(version: str) -> None:
    with pytest.raises(UnsupportedVllmVersion, match=r"supports vLLM 0.19.x to 0.34.x"):
        check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.19.0", "0.23.1", "0.30.0", "0.34.0"])
def test_every_series_from_0_19_to_0_34_is_accepted(version: str) -> None:
    assert check_vllm_version(version) == version[:4]


def test_every_supported_series_has_its_own_layout() -> None:
    assert set(LAYOUT_BY_SERIES) == set(SUPPORTED_VLLM)
    assert SUPPORTED_VLLM[0] == "0.19" and SUPPORTED_VLLM[-1] == "0.34"
    # and every internal names only supported series
    assert {s for item in INTERNALS for s in item.series} <= set(SUPPORTED_VLLM)
