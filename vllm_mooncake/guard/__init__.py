"""The wedge guard, the product's core.

Reading path (``docs/architecture.md`` draws the rooms and what each may
touch, and follows one request through vLLM's hooks):

1. ``ledger.py``          -- every request's KV blocks, owning child and
                             receive state (a plain class, no vLLM import);
2. ``config.py``          -- the ``wedge_guard`` section of
                             ``kv_transfer_config``, validated by field;
3. ``connector.py``       -- ``WedgeGuardConnector``: a MultiConnector facade
                             that routes each hook and reports it, in one
                             call, to 4.;
4. ``scheduler_side.py``  -- the guard's state, built only in the scheduler
                             process: the ledger, the stats, and its rooms:
   ``ownership.py``       -- which child loads a request, the allocation
                             order, the load-retry budget, child faults;
   ``notices.py``         -- receive notices, filtered once per output;
   ``stall_watch.py``     -- holder gauges, the wedge alarm, the stuck flag;
   ``receive_watch.py``   -- deadlines and sender probes of receives in
                             flight (``senders.py``: who writes a receive);
   ``quarantine.py``      -- blocks a failed receive may still be written
                             into, kept from reuse;
5. ``scheduler.py``       -- the guarded schedulers: the overrides, each
                             calling ``super()``; with
   ``valve.py``           -- lateral preemption when admission fails with
                             nothing running;
   ``holders.py``         -- what the guard reads of vLLM's waiting holders;
   ``observer.py``        -- the seam tests and tools watch the guard through;
   ``stranded.py``        -- receives that will not land, failed safely;
6. ``routing.py``, ``containment.py``, ``stats.py``, ``kv_stats.py``,
   ``metrics.py`` -- routing by ``kv_transfer_params``, children that raise,
   counters, their path through vLLM's stats, Prometheus.

What differs between vLLM releases lives in ``vllm_mooncake/compat``.
Importing this package imports nothing else.
"""

__all__: list[str] = []  # the modules are the surface
