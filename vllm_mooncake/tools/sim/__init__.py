"""A discrete-event PD simulator over vLLM's real scheduler.

Each rank is vLLM 0.32's ``Scheduler`` / ``KVCacheManager`` behind the guard
connector (through :mod:`vllm_mooncake.testing.driver`); only the forward
pass (a cost model), the KV bytes (scripted transfers) and the clock are
simulated. Reading path:

1. ``scenario.py`` -- the scenario file: schema and validation (no vLLM).
2. ``workload.py`` -- the requests of a run, fixed by the seed.
3. ``cost.py``     -- how long a step takes.
4. ``rank.py``     -- one engine: a driver, a clock, stall tracking (``stalls.py``).
5. ``cluster.py``  -- the event loop: router, hand-off, pulls, leases.
6. ``recorder.py`` / ``results.py`` -- what a run observed; the JSON result.
7. ``compare.py`` / ``plot.py`` / ``__main__.py`` -- policies side by side, the
   PNG, the ``vllm-mooncake-sim`` command.
"""

from vllm_mooncake.tools.sim.errors import ScenarioError, SimulationError
from vllm_mooncake.tools.sim.results import RunResult
from vllm_mooncake.tools.sim.scenario import Scenario, load_scenario, parse_scenario

__all__ = [
    "RunResult",
    "Scenario",
    "ScenarioError",
    "SimulationError",
    "load_scenario",
    "parse_scenario",
]
