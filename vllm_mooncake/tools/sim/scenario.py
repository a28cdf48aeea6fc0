"""The scenario file: schema, defaults and validation (no vLLM import).

A scenario is one YAML (or JSON) mapping; ``docs/simulator.md`` documents
every field. Sections:

* ``mode``      -- ``pd`` (prefill ranks hand requests to decode ranks) or
  ``single`` (one rank, for wedge reproductions).
* ``ranks``     -- PD shape: ``prefill`` / ``decode`` counts and the router.
* ``engine``    -- vLLM knobs of every rank; ``prefill_engine`` /
  ``decode_engine`` override them per role.
* ``guard``     -- the guard connector's ``wedge_guard`` section.
* ``cost``      -- the forward-pass cost model (:mod:`.cost`).
* ``pd``        -- the P->D hand-off, the NIXL-like transfer and the lease.
* ``limits``    -- when a run stops: simulated time, steps, wedge detection.
* ``workload`` (generated) or ``requests`` (a scripted list) -- exactly one.
* ``expect``    -- per policy, the outcome (``finished`` / ``wedged`` /
  ``livelock``) and optionally bounds on ``lateral_preemptions``
  (``{outcome: finished, lateral_preemptions: {max: 2}}``), which
  ``compare --check`` and the tests assert.

:func:`parse_scenario` turns the mapping into frozen dataclasses; every error
is a :class:`ScenarioError` naming the field (``ranks.decode: expected an
integer >= 1, got -1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_mooncake.guard.config import POLICY_NAMES
from vllm_mooncake.tools.sim.dist import Dist
from vllm_mooncake.tools.sim.errors import ScenarioError
from vllm_mooncake.tools.sim.reader import Reader

SCHEMA_VERSION = 1
MODES = ("pd", "single")
ROUTERS = ("round_robin", "least_loaded")
ARRIVALS = ("closed", "poisson")
OUTCOMES = ("ok", "fail", "partial")
EXPECTED = ("finished", "wedged", "livelock")
CHILDREN = ("store", "pd")


@dataclass(frozen=True)
class EngineSpec:
    """vLLM knobs of one rank (``num_blocks`` counts vLLM's null block)."""

    num_blocks: int = 1025
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 16384
    policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True
    kv_load_failure_policy: str = "fail"
    async_scheduling: bool = False
    enable_prefix_caching: bool = True

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class RanksSpec:
    prefill: int = 1
    decode: int = 1
    router: str = "round_robin"


@dataclass(frozen=True)
class GuardSpec:
    policy: str = "reserve+lateral"
    max_attempts: int = 16
    stall_alarm_steps: int = 2000
    only_when_idle: bool = True
    max_failed_loads: int = 3
    strict: bool = False

    def section(self) -> dict[str, Any]:
        """The ``wedge_guard`` section of ``kv_transfer_config``."""
        return {
            "max_attempts": self.max_attempts,
            "stall_alarm_steps": self.stall_alarm_steps,
            "only_when_idle": self.only_when_idle,
            "max_failed_loads": self.max_failed_loads,
            "strict": self.strict,
        }


@dataclass(frozen=True)
class CostSpec:
    fixed_s: float = 0.004
    per_token_s: float = 2e-5
    per_seq_s: float = 5e-5
    idle_tick_s: float = 0.001


@dataclass(frozen=True)
class TransferSpec:
    """Latency ``latency_s + per_token_s * tokens``; seeded faults."""

    latency_s: Dist = field(default_factory=lambda: Dist.constant(0.02))
    per_token_s: float = 0.0
    fail_rate: float = 0.0
    partial_rate: float = 0.0


@dataclass(frozen=True)
class PDSpec:
    handoff_s: float = 0.001
    lease_s: float = 30.0
    transfer: TransferSpec = field(default_factory=TransferSpec)


@dataclass(frozen=True)
class StoreSpec:
    hit_ratio: float = 0.0
    hit_fraction: Dist = field(default_factory=lambda: Dist.constant(0.5))
    load: TransferSpec = field(default_factory=TransferSpec)


@dataclass(frozen=True)
class WorkloadSpec:
    arrival: str = "closed"
    num_requests: int = 64
    concurrency: int = 16
    rate_per_s: float = 10.0
    think_time_s: Dist = field(default_factory=lambda: Dist.constant(0.0))
    prompt_tokens: Dist = field(default_factory=lambda: Dist.constant(512))
    output_tokens: Dist = field(default_factory=lambda: Dist.constant(64))
    priority: Dist = field(default_factory=lambda: Dist.constant(0))
    pd_fraction: float = 1.0
    store: StoreSpec = field(default_factory=StoreSpec)


@dataclass(frozen=True)
class LoadSpec:
    """A scripted request's async load (its ``kv_transfer_params``)."""

    child: str = "store"
    tokens: int = -1
    done_after_steps: int | None = None
    done_after_s: float | None = None
    outcome: str = "ok"
    valid_tokens: int = 0
    failing_attempts: int = -1


@dataclass(frozen=True)
class RequestEntry:
    id: str
    prompt_tokens: int
    max_tokens: int = 16
    priority: int = 0
    arrival_s: float | None = None
    arrival_step: int | None = None
    route: str = "pd"
    load: LoadSpec | None = None
    transfer: LoadSpec | None = None
    # Abort the request (vLLM's finish_requests, FINISHED_ABORTED) at this
    # simulated time, or (single mode) before this rank step; None: never.
    abort_at_s: float | None = None
    abort_at_step: int | None = None


@dataclass(frozen=True)
class Expectation:
    """What ``expect.<policy>`` asks of a run under that policy."""

    outcome: str | None = "finished"  # None: any outcome
    lateral_min: int | None = None
    lateral_max: int | None = None

    def problems(self, outcome: str, lateral_preemptions: int) -> list[str]:
        """What a run with ``outcome`` and that many laterals misses."""
        out = []
        if self.outcome is not None and outcome != self.outcome:
            out.append(f"expected {self.outcome}, got {outcome}")
        lo, hi = self.lateral_min, self.lateral_max
        if lo is not None and lateral_preemptions < lo:
            out.append(
                f"expected lateral_preemptions >= {lo}, got {lateral_preemptions}"
            )
        if hi is not None and lateral_preemptions > hi:
            out.append(
                f"expected lateral_preemptions <= {hi}, got {lateral_preemptions}"
            )
        return out


@dataclass(frozen=True)
class LimitsSpec:
    max_sim_s: float = 3600.0
    max_steps: int = 2_000_000
    wedge_steps: int = 500
    # Loads one request starts without sampling a token in between before
    # the run stops as a livelock (the request reloads forever).
    livelock_loads: int = 20


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str = ""
    seed: int = 0
    mode: str = "pd"
    ranks: RanksSpec = field(default_factory=RanksSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    prefill_engine: EngineSpec = field(default_factory=EngineSpec)
    decode_engine: EngineSpec = field(default_factory=EngineSpec)
    guard: GuardSpec = field(default_factory=GuardSpec)
    cost: CostSpec = field(default_factory=CostSpec)
    pd: PDSpec = field(default_factory=PDSpec)
    limits: LimitsSpec = field(default_factory=LimitsSpec)
    workload: WorkloadSpec | None = None
    requests: tuple[RequestEntry, ...] = ()
    expect: tuple[tuple[str, Expectation], ...] = ()
    source: str = ""

    @property
    def policy(self) -> str:
        return self.guard.policy

    def expected(self) -> dict[str, str]:
        """The expected outcome per policy (policies that name one)."""
        return {p: e.outcome for p, e in self.expect if e.outcome is not None}

    def expectations(self) -> dict[str, Expectation]:
        return dict(self.expect)

    def with_policy(self, policy: str) -> Scenario:
        if policy not in POLICY_NAMES:
            raise ScenarioError("guard.policy", _one_of(POLICY_NAMES, policy))
        return replace(self, guard=replace(self.guard, policy=policy))

    def with_seed(self, seed: int) -> Scenario:
        return replace(self, seed=seed)

    def scaled(self, factor: float) -> Scenario:
        """Load and capacity times ``factor``, for CI-sized runs.

        Scales the generated workload (``num_requests``, ``concurrency``,
        ``rate_per_s``) and every rank's ``num_blocks`` (usable part) and
        ``max_num_seqs``. Request lengths, latencies and scripted request
        lists are left alone.
        """
        if factor <= 0:
            raise ScenarioError("--scale", f"expected a number > 0, got {factor!r}")
        if factor == 1 or self.workload is None:
            return self
        w = self.workload
        workload = replace(
            w,
            num_requests=_scale_int(w.num_requests, factor),
            concurrency=_scale_int(w.concurrency, factor),
            rate_per_s=w.rate_per_s * factor,
        )
        return replace(
            self,
            workload=workload,
            engine=_scale_engine(self.engine, factor),
            prefill_engine=_scale_engine(self.prefill_engine, factor),
            decode_engine=_scale_engine(self.decode_engine, factor),
        )


def _scale_int(n: int, factor: float) -> int:
    return max(1, round(n * factor))


def _scale_engine(engine: EngineSpec, factor: float) -> EngineSpec:
    return replace(
        engine,
        num_blocks=_scale_int(engine.usable_blocks, factor) + 1,
        max_num_seqs=_scale_int(engine.max_num_seqs, factor),
    )


def _one_of(options: tuple[str, ...], got: object) -> str:
    return f"expected one of {', '.join(repr(o) for o in options)}, got {got!r}"


# ---- loading ------------------------------------------------------------------
def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file (YAML, or JSON, which YAML includes)."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError("", f"cannot read: {exc.strerror}", str(path)) from exc
    except yaml.YAMLError as exc:
        raise ScenarioError("", f"not valid YAML: {exc}", str(path)) from exc
    try:
        return parse_scenario(raw, default_name=path.stem, source=str(path))
    except ScenarioError as exc:
        raise exc.with_source(str(path)) from None


def parse_scenario(
    raw: object, default_name: str = "scenario", source: str = ""
) -> Scenario:
    """Validate a parsed mapping; raises :class:`ScenarioError` by field."""
    top = Reader(raw)
    version = top.integer("version", SCHEMA_VERSION, SCHEMA_VERSION, SCHEMA_VERSION)
    del version  # one schema so far; the field is there for the next one
    mode = top.choice("mode", "pd", MODES)
    engine = _engine(top.section("engine"), EngineSpec())
    scenario = Scenario(
        name=top.string("name", default_name),
        description=top.string("description", ""),
        seed=top.integer("seed", 0, 0),
        mode=mode,
        ranks=_ranks(top, mode),
        engine=engine,
        prefill_engine=_role_engine(top, "prefill_engine", engine, mode),
        decode_engine=_role_engine(top, "decode_engine", engine, mode),
        guard=_guard(top.section("guard")),
        cost=_cost(top.section("cost")),
        pd=_pd(top.section("pd")),
        limits=_limits(top.section("limits")),
        workload=_workload(top),
        requests=_requests(top, mode),
        expect=_expect(top.section("expect")),
        source=source,
    )
    top.done()
    if scenario.workload is None and not scenario.requests:
        raise ScenarioError("workload", "give either a workload or a requests list")
    _check_fit(scenario)
    return scenario


def _engine(r: Reader, base: EngineSpec) -> EngineSpec:
    spec = EngineSpec(
        num_blocks=r.integer("num_blocks", base.num_blocks, 2),
        block_size=r.integer("block_size", base.block_size, 1),
        max_num_seqs=r.integer("max_num_seqs", base.max_num_seqs, 1),
        max_num_batched_tokens=r.integer(
            "max_num_batched_tokens", base.max_num_batched_tokens, 1
        ),
        max_model_len=r.integer("max_model_len", base.max_model_len, 1),
        policy=r.choice("policy", base.policy, ("fcfs", "priority")),
        scheduler_reserve_full_isl=r.boolean(
            "scheduler_reserve_full_isl", base.scheduler_reserve_full_isl
        ),
        kv_load_failure_policy=r.choice(
            "kv_load_failure_policy", base.kv_load_failure_policy, ("fail", "recompute")
        ),
        async_scheduling=r.boolean("async_scheduling", base.async_scheduling),
        enable_prefix_caching=r.boolean(
            "enable_prefix_caching", base.enable_prefix_caching
        ),
    )
    r.done()
    return spec


def _role_engine(top: Reader, name: str, base: EngineSpec, mode: str) -> EngineSpec:
    if mode == "single" and top.has(name):
        raise ScenarioError(
            name, "only for mode: pd (single mode has one rank: engine)"
        )
    return _engine(top.section(name), base)


def _ranks(top: Reader, mode: str) -> RanksSpec:
    if mode == "single" and top.has("ranks"):
        raise ScenarioError("ranks", "only for mode: pd (single mode has one rank)")
    r = top.section("ranks")
    spec = RanksSpec(
        prefill=r.integer("prefill", 1, 1),
        decode=r.integer("decode", 1, 1),
        router=r.choice("router", "round_robin", ROUTERS),
    )
    r.done()
    return spec


def _guard(r: Reader) -> GuardSpec:
    spec = GuardSpec(
        policy=r.choice("policy", GuardSpec.policy, POLICY_NAMES),
        max_attempts=r.integer("max_attempts", GuardSpec.max_attempts, 1, 1024),
        stall_alarm_steps=r.integer(
            "stall_alarm_steps", GuardSpec.stall_alarm_steps, 1
        ),
        only_when_idle=r.boolean("only_when_idle", GuardSpec.only_when_idle),
        max_failed_loads=r.integer(
            "max_failed_loads", GuardSpec.max_failed_loads, 1, 1000
        ),
        strict=r.boolean("strict", GuardSpec.strict),
    )
    r.done()
    return spec


def _cost(r: Reader) -> CostSpec:
    spec = CostSpec(
        fixed_s=r.number("fixed_s", CostSpec.fixed_s, 0),
        per_token_s=r.number("per_token_s", CostSpec.per_token_s, 0),
        per_seq_s=r.number("per_seq_s", CostSpec.per_seq_s, 0),
        idle_tick_s=r.number("idle_tick_s", CostSpec.idle_tick_s, 0, lo_open=True),
    )
    r.done()
    return spec


def _transfer_fields(r: Reader, base: TransferSpec) -> TransferSpec:
    spec = TransferSpec(
        latency_s=r.dist("latency_s", base.latency_s, minimum=0),
        per_token_s=r.number("per_token_s", base.per_token_s, 0),
        fail_rate=r.number("fail_rate", base.fail_rate, 0, 1),
        partial_rate=r.number("partial_rate", base.partial_rate, 0, 1),
    )
    if spec.fail_rate + spec.partial_rate > 1:
        raise ScenarioError(
            r.where("partial_rate"), "fail_rate + partial_rate exceeds 1"
        )
    return spec


def _pd(r: Reader) -> PDSpec:
    spec = PDSpec(
        handoff_s=r.number("handoff_s", PDSpec.handoff_s, 0),
        lease_s=r.number("lease_s", PDSpec.lease_s, 0, lo_open=True),
        transfer=_transfer(r.section("transfer")),
    )
    r.done()
    return spec


def _transfer(r: Reader) -> TransferSpec:
    spec = _transfer_fields(r, TransferSpec())
    r.done()
    return spec


def _limits(r: Reader) -> LimitsSpec:
    spec = LimitsSpec(
        max_sim_s=r.number("max_sim_s", LimitsSpec.max_sim_s, 0, lo_open=True),
        max_steps=r.integer("max_steps", LimitsSpec.max_steps, 1),
        wedge_steps=r.integer("wedge_steps", LimitsSpec.wedge_steps, 1),
        livelock_loads=r.integer("livelock_loads", LimitsSpec.livelock_loads, 2),
    )
    r.done()
    return spec


def _store(r: Reader) -> StoreSpec:
    hit_fraction = r.dist("hit_fraction", StoreSpec().hit_fraction, minimum=0)
    if hit_fraction.upper_bound() > 1:
        raise ScenarioError(r.where("hit_fraction"), "draws can exceed 1; add max: 1")
    spec = StoreSpec(
        hit_ratio=r.number("hit_ratio", 0.0, 0, 1),
        hit_fraction=hit_fraction,
        load=_transfer_fields(r, TransferSpec(latency_s=Dist.constant(0.01))),
    )
    r.done()
    return spec


def _workload(top: Reader) -> WorkloadSpec | None:
    if top.optional_section("workload") is None:
        return None
    if top.has("requests"):
        raise ScenarioError("requests", "give either workload or requests, not both")
    r = top.section("workload")
    arrival = r.choice("arrival", "closed", ARRIVALS)
    spec = WorkloadSpec(
        arrival=arrival,
        num_requests=r.integer("num_requests", WorkloadSpec.num_requests, 1),
        concurrency=r.integer("concurrency", WorkloadSpec.concurrency, 1),
        rate_per_s=r.number("rate_per_s", WorkloadSpec.rate_per_s, 0, lo_open=True),
        think_time_s=r.dist("think_time_s", Dist.constant(0.0), minimum=0),
        prompt_tokens=r.dist("prompt_tokens", Dist.constant(512), minimum=1),
        output_tokens=r.dist("output_tokens", Dist.constant(64), minimum=1),
        priority=r.dist("priority", Dist.constant(0)),
        pd_fraction=r.number("pd_fraction", 1.0, 0, 1),
        store=_store(r.section("store")),
    )
    r.done()
    return spec


def _requests(top: Reader, mode: str) -> tuple[RequestEntry, ...]:
    items = top.items("requests")
    if items is None:
        return ()
    if not items:
        raise ScenarioError("requests", "expected at least one request")
    entries = tuple(
        _request(Reader(item, f"requests[{i}]"), i, mode)
        for i, item in enumerate(items)
    )
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if entry.id in seen:
            raise ScenarioError(
                f"requests[{i}].id", f"{entry.id!r} repeats requests[{seen[entry.id]}]"
            )
        seen[entry.id] = i
    return entries


def _request(r: Reader, index: int, mode: str) -> RequestEntry:
    if not r.has("prompt_tokens"):
        raise ScenarioError(r.where("prompt_tokens"), "required")
    if mode == "single" and r.has("route"):
        raise ScenarioError(r.where("route"), "only for mode: pd")
    route = r.choice("route", "pd", ("pd", "direct"))
    arrival_step, arrival_s = _arrival(r, mode)
    load = r.optional_section("load")
    transfer = r.optional_section("transfer")
    abort_step, abort_s = _abort(r, mode)
    entry = RequestEntry(
        id=r.string("id", f"r{index}"),
        prompt_tokens=r.integer("prompt_tokens", 0, 1),
        max_tokens=r.integer("max_tokens", 16, 1),
        priority=r.integer("priority", 0),
        arrival_s=arrival_s,
        arrival_step=arrival_step,
        route=route,
        load=None if load is None else _load(load, mode),
        transfer=None
        if transfer is None
        else _transfer_override(transfer, mode, route),
        abort_at_s=abort_s,
        abort_at_step=abort_step,
    )
    r.done()
    if entry.load is not None and entry.load.tokens > entry.prompt_tokens:
        raise ScenarioError(
            r.where("load.tokens"),
            f"{entry.load.tokens} exceeds prompt_tokens ({entry.prompt_tokens})",
        )
    _check_valid_tokens(r, "load", entry.load, entry.prompt_tokens)
    _check_valid_tokens(r, "transfer", entry.transfer, entry.prompt_tokens)
    _check_abort(r, entry)
    return entry


def _check_valid_tokens(
    r: Reader, name: str, load: LoadSpec | None, prompt_tokens: int
) -> None:
    """``valid_tokens`` (tokens that arrived) cannot exceed the tokens offered."""
    if load is None:
        return
    if load.tokens == -1:
        offered, what = (
            prompt_tokens,
            f"prompt_tokens ({prompt_tokens}; {name}.tokens is -1: the whole prompt)",
        )
    else:
        offered, what = load.tokens, f"{name}.tokens ({load.tokens})"
    if load.valid_tokens > offered:
        raise ScenarioError(
            r.where(f"{name}.valid_tokens"),
            f"{load.valid_tokens} exceeds {what}; give at most {offered} "
            "(the tokens of the load that arrived; outcome: ok for all of them)",
        )


def _abort(r: Reader, mode: str) -> tuple[int | None, float | None]:
    """(abort_at_step, abort_at_s): at most one is set."""
    step = r.optional_integer("abort_at_step", 0)
    seconds = r.optional_number("abort_at_s", 0)
    if step is not None and seconds is not None:
        raise ScenarioError(
            r.where("abort_at_step"), "give abort_at_step or abort_at_s, not both"
        )
    if step is not None and mode != "single":
        raise ScenarioError(
            r.where("abort_at_step"),
            "only for mode: single (pd ranks share no step count); use abort_at_s",
        )
    return step, seconds


def _check_abort(r: Reader, entry: RequestEntry) -> None:
    step, arrival_step = entry.abort_at_step, entry.arrival_step
    if step is not None and arrival_step is not None and step < arrival_step:
        raise ScenarioError(
            r.where("abort_at_step"),
            f"{step} is before arrival_step ({arrival_step}); abort at or after "
            "the arrival",
        )
    at, arrival_s = entry.abort_at_s, entry.arrival_s
    if at is not None and arrival_s is not None and at < arrival_s:
        raise ScenarioError(
            r.where("abort_at_s"),
            f"{at} is before arrival_s ({arrival_s}); abort at or after the arrival",
        )


def _arrival(r: Reader, mode: str) -> tuple[int | None, float | None]:
    """(arrival_step, arrival_s): exactly one is set (default: at 0 s)."""
    step = r.optional_integer("arrival_step", 0)
    seconds = r.optional_number("arrival_s", 0)
    if step is None:
        return None, seconds or 0.0
    if seconds is not None:
        raise ScenarioError(
            r.where("arrival_step"), "give arrival_step or arrival_s, not both"
        )
    if mode != "single":
        raise ScenarioError(
            r.where("arrival_step"),
            "only for mode: single (pd ranks share no step count)",
        )
    return step, None


def _load(r: Reader, mode: str) -> LoadSpec:
    child = r.choice("child", "store", CHILDREN)
    if mode == "pd" and child == "pd":
        raise ScenarioError(
            r.where("child"),
            "'pd' is only for mode: single; in pd mode the simulator makes the "
            "P->D transfer (tune it with transfer:)",
        )
    steps = r.optional_integer("done_after_steps", 0)
    seconds = r.optional_number("done_after_s", 0)
    if steps is not None and seconds is not None:
        raise ScenarioError(
            r.where("done_after_steps"),
            "give done_after_steps or done_after_s, not both",
        )
    spec = LoadSpec(
        child=child,
        tokens=r.integer("tokens", -1, -1),
        done_after_steps=1 if steps is None and seconds is None else steps,
        done_after_s=seconds,
        outcome=r.choice("outcome", "ok", OUTCOMES),
        valid_tokens=r.integer("valid_tokens", 0, 0),
        failing_attempts=r.integer("failing_attempts", -1, -1),
    )
    r.done()
    return spec


def _transfer_override(r: Reader, mode: str, route: str) -> LoadSpec:
    """A request's own P->D transfer; ``done_after_s`` absent: drawn from pd."""
    if mode != "pd" or route != "pd":
        raise ScenarioError(r.path, "only for route: pd requests in mode: pd")
    spec = LoadSpec(
        child="pd",
        done_after_steps=None,
        done_after_s=r.optional_number("done_after_s", 0),
        outcome=r.choice("outcome", "ok", OUTCOMES),
        valid_tokens=r.integer("valid_tokens", 0, 0),
    )
    r.done()
    return spec


def _expect(r: Reader) -> tuple[tuple[str, Expectation], ...]:
    """``expect.<policy>``: an outcome, or ``{outcome, lateral_preemptions}``."""
    out = []
    for policy in r.raw:
        if policy not in POLICY_NAMES:
            raise ScenarioError(
                r.where(str(policy)), f"not a policy; {_one_of(POLICY_NAMES, policy)}"
            )
        name = str(policy)
        if isinstance(r.raw[name], dict):
            out.append((name, _expectation(r.section(name))))
        else:
            out.append((name, Expectation(r.choice(name, "finished", EXPECTED))))
    r.done()
    return tuple(out)


def _expectation(r: Reader) -> Expectation:
    outcome = r.choice("outcome", "", EXPECTED) or None
    bounds = r.optional_section("lateral_preemptions")
    lo = hi = None
    if bounds is not None:
        lo = bounds.optional_integer("min", 0)
        hi = bounds.optional_integer("max", 0)
        bounds.done()
        if lo is None and hi is None:
            raise ScenarioError(bounds.path, "give min:, max: or both")
        if lo is not None and hi is not None and lo > hi:
            raise ScenarioError(bounds.where("min"), f"{lo} exceeds max ({hi})")
    r.done()
    if outcome is None and bounds is None:
        raise ScenarioError(r.path, "give outcome:, lateral_preemptions: or both")
    return Expectation(outcome, lo, hi)


# ---- cross-field checks ---------------------------------------------------------
def _check_fit(s: Scenario) -> None:
    """Every request must fit the pools it visits, or it is no wedge, just too big."""
    engines = (
        [("engine", s.engine)]
        if s.mode == "single"
        else [("prefill_engine", s.prefill_engine), ("decode_engine", s.decode_engine)]
    )
    for where, prompt, output in _largest_requests(s):
        for name, engine in engines:
            need = engine.blocks_for(prompt + output)
            if prompt + output > engine.max_model_len:
                raise ScenarioError(
                    where,
                    f"prompt + output ({prompt + output} tokens) exceeds "
                    f"{name}.max_model_len ({engine.max_model_len})",
                )
            if need > engine.usable_blocks:
                raise ScenarioError(
                    where,
                    f"a request of {prompt} + {output} tokens needs {need} blocks but "
                    f"{name}.num_blocks leaves {engine.usable_blocks} usable",
                )


def _largest_requests(s: Scenario) -> list[tuple[str, int, int]]:
    if s.workload is not None:
        w = s.workload
        prompt, output = w.prompt_tokens.upper_bound(), w.output_tokens.upper_bound()
        if prompt == float("inf") or output == float("inf"):
            field_ = "prompt_tokens" if prompt == float("inf") else "output_tokens"
            raise ScenarioError(f"workload.{field_}", "unbounded draws; add max:")
        return [("workload.prompt_tokens", int(prompt), int(output))]
    return [
        (f"requests[{i}].prompt_tokens", r.prompt_tokens, r.max_tokens)
        for i, r in enumerate(s.requests)
    ]
