"""Generated runs of vLLM's real scheduler with the guard keep every invariant.

Hypothesis draws whole runs (``vllm_mooncake.testing.cases``): arrivals,
prompt and output lengths, priorities, FCFS or priority scheduling, the
full-ISL check, async scheduling, pools down to barely one request, async
(and sync) loads through the store child and the P->D child with delays,
full and partial failures and retries under both ``kv_load_failure_policy``
values, deferred lookups, child connectors raising in a per-request hook,
duplicate / late / unknown receive notices, and
aborts (at a step, of a lateral victim, of the request it admitted, in the
middle of a stall). After every step the checker of
``vllm_mooncake.testing.invariants`` checks block conservation, that no
block under an in-flight receive is freed, the ledger against the scheduler
and the worker, that nothing is sent to the worker as resumed unseen, and
(lateral policies) stalls with a victim left; at the end, that every request
ended with a reason it may have and nothing is left behind. The same
checker holds the guard to its policy, not only to safety: a lateral
preemption only after a failed admission, with the ledger's victim, within
the per-call budget and (``only_when_idle``) with nothing running, never
more than the head needed, leaving the victim as never admitted and the
ledger told; every admission checked against a freshly computed
reservation; a re-admitted victim hitting the KV it had cached; the wedge
alarm once per stall, re-armed after it; every lookup sent to the child
whose params the request carries (``tests/test_invariants_catch_broken_
guards.py`` breaks the guard in each of these ways and sees a check fire).

``VLLM_MOONCAKE_PROPERTY_EXAMPLES`` sets the examples per property (default
below, a sample sized for CI's budget: about 25 ms an example, so the two
properties take about 1 minute 40 s on 2 cores; 6,000 each took 4 minutes
40 s); ``bench/property_run.py`` runs the same space for 100,000+ cases. A
failure prints the shrunk case as JSON; replay it with ``Case.from_json`` +
``run_case``.

The last tests replay, as plain examples, the two guard bugs the properties
found (both fixed in ``guard/scheduler.py`` / ``guard/connector.py``).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, event, given, note, settings, target
from hypothesis import strategies as st

from vllm_mooncake.testing.cases import (
    Case,
    Fault,
    Load,
    Req,
    WeightedDraw,
    draw_case,
    run_case,
)

EXAMPLES = int(os.environ.get("VLLM_MOONCAKE_PROPERTY_EXAMPLES", "2000"))
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def cases(draw: st.DrawFn, **kwargs: object) -> Case:
    def integer(lo: int, hi: int) -> int:
        return draw(st.integers(lo, hi))

    return draw_case(WeightedDraw(integer), **kwargs)  # type: ignore[arg-type]


def _run(case: Case) -> int:
    """Run ``case``; return its lateral preemptions."""
    note(f"case: {case.to_json()}")
    result = run_case(case)
    event(f"policy {case.policy}")
    event("lateral preemption" if result.laterals else "no lateral preemption")
    if result.mid_wedge_aborts:
        event("abort mid-wedge")
    if result.notices_injected:
        event("stray receive notices")
    if result.errored:
        event("failed load ended a request")
    if any(r.load and r.load.raise_in for r in case.requests):
        event("a child connector raised in a hook")
    if result.wedged:
        event("valve-less policy wedged (aborted)")
    return result.laterals


@PROPERTY
@given(cases())
def test_generated_runs_keep_every_invariant(case: Case) -> None:
    _run(case)


@PROPERTY
@given(cases(policies=("reserve+lateral", "lateral"), burst=True))
def test_wedge_prone_runs_keep_every_invariant(case: Case) -> None:
    """Bursts of async loads into tight pools: where wedges form and the
    valve preempts laterally (and where victims and targets are aborted).
    Hypothesis is steered towards runs with more lateral preemptions."""
    target(float(_run(case)), label="lateral preemptions")


def test_a_case_round_trips_through_json() -> None:
    case = draw_case(WeightedDraw(lambda lo, hi: hi))
    assert Case.from_json(case.to_json()) == case


# ---- what the properties found (fixed; kept as plain examples) -----------------
def test_lone_request_reserving_against_itself_is_admitted() -> None:
    """W2 with one request: its store load fails entirely under
    ``recompute``; vLLM frees its blocks but keeps it in ``_inflight_prefills``
    and, when the store offers the hit again, reserves its own remaining
    blocks against its own admission. With a pool under twice its need it
    never fits and, alone, offers no victim: under the default policy it
    waited forever. The valve now drops that stale self-reservation."""
    load = Load(
        "store", tokens=11, done_after=1, outcome="partial", valid_tokens=8,
        failing_attempts=1, reoffer=True,
    )  # fmt: skip
    case = Case(
        policy="reserve+lateral",
        requests=(Req("r0", 0, prompt_len=187, max_tokens=1, load=load),),
        num_blocks=12,
        failure_policy="recompute",
    )
    result = run_case(case)
    assert result.laterals == 0
    # The retried load (ok the second time) brought 11 tokens in.
    assert result.scheduled_tokens["r0"] == 187 - 11


@pytest.mark.parametrize("failure_policy", ["fail", "recompute"])
def test_duplicate_failure_notice_does_not_touch_a_loaded_request(
    failure_policy: str,
) -> None:
    """A duplicate notice that a receive *failed*, for a request whose
    receive already succeeded and that waits to be promoted: vLLM reads
    ``failed_recving`` before the connector's ``update_connector_output``,
    so the guard's filter came too late and the loaded request was failed
    (``fail``) or reset (``recompute``). The guarded scheduler now filters
    first."""
    # One slot: "decode" runs, so "loaded" (its receive done at step 0) waits
    # in WAITING_FOR_REMOTE_KVS when the stray notice comes at step 3.
    case = Case(
        policy="reserve+lateral",
        requests=(
            Req("loaded", 0, prompt_len=60, max_tokens=2, load=Load("pd", -1, 0)),
            Req("decode", 0, prompt_len=100, max_tokens=12),
        ),
        num_blocks=30,
        failure_policy=failure_policy,
        max_num_seqs=1,
        faults=(Fault("notice", 3, notice="duplicate", failed=True),),
    )
    result = run_case(case)
    assert result.notices_injected == 1
    assert result.errored == 0
    # Promoted with its KV: the last prompt token, then one decode step.
    assert result.scheduled_tokens["loaded"] == 2
