"""The worker's outputs, built the way each vLLM release 0.19-0.34 takes them.

Two constructors the fake worker calls changed across releases
(``docs/release-survey.md``, section 4a):

- ``ModelRunnerOutput``: ``req_id_to_index`` exists up to 0.33; 0.34 removed
  it (the order of ``req_ids`` is the index).
- ``KVConnectorOutput``: ``failed_recving`` exists from 0.30. Before, a
  failed async load is reported the way those releases' workers report it:
  as a *finished* receive with every block it was to fill in
  ``invalid_block_ids`` (vLLM then puts it in ``failed_recving_kv_req_ids``
  and, under ``recompute``, recomputes it).

Which form applies is read from the installed release's dataclass fields, and
``tests/test_vllm_releases.py`` checks the field sets against the releases.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence

from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from vllm_mooncake.compat.releases import kv_output_has_failed_recving


@functools.cache
def runner_output_has_req_id_to_index() -> bool:
    """0.19-0.33: ``ModelRunnerOutput(req_id_to_index=...)``; gone in 0.34."""
    return "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def model_runner_output(
    req_ids: Sequence[str],
    sampled_token_ids: list[list[int]],
    kv_connector_output: KVConnectorOutput,
) -> ModelRunnerOutput:
    if runner_output_has_req_id_to_index():
        return ModelRunnerOutput(
            req_ids=list(req_ids),
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled_token_ids,
            kv_connector_output=kv_connector_output,
        )
    return ModelRunnerOutput(
        req_ids=list(req_ids),
        sampled_token_ids=sampled_token_ids,
        kv_connector_output=kv_connector_output,
    )


def kv_connector_output(
    finished_sending: set[str],
    finished_recving: set[str],
    failed_recving: set[str],
    invalid_block_ids: set[int],
    failed_blocks: Iterable[int] = (),
) -> KVConnectorOutput:
    """``failed_blocks``: the blocks the failed receives were to fill; used
    only before 0.30, where they are how a failure is reported."""
    if kv_output_has_failed_recving():
        return KVConnectorOutput(
            finished_sending=finished_sending or None,
            finished_recving=(finished_recving | failed_recving) or None,
            failed_recving=failed_recving,
            invalid_block_ids=invalid_block_ids,
        )
    return KVConnectorOutput(
        finished_sending=finished_sending or None,
        finished_recving=(finished_recving | failed_recving) or None,
        invalid_block_ids=invalid_block_ids | set(failed_blocks),
    )
