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
        INTERNALS[0].owner, "_free_request_blocks", "method", "example", ("req",)
    )
    assert "_no_such_queue: attribute is no longer set" in (check_internal(gone) or "")
    assert "parameter(s) ['req'] are gone" in (check_internal(renamed) or "")


def test_installed_vllm_is_supported() -> None:
    assert check_vllm_version() in SUPPORTED_VLLM
    assert not missing_internals()
    assert installed_vllm_version()[:4] in SUPPORTED_VLLM


@pytest.mark.parametrize("version", ["0.29.1", "0.33.0", "1.0.0"])
def test_unsupported_versions_fail_with_the_supported_list(version: str) -> None:
    with pytest.raises(
        UnsupportedVllmVersion, match=r"supports vLLM 0.30.x, 0.31.x, 0.32.x"
    ):
        check_vllm_version(version)
