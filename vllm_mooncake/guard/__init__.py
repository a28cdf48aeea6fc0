"""The wedge guard, the product's core.

Reading path:

1. ``ledger.py``          -- every request's KV blocks, owning child and
                             receive state (a plain class, no vLLM import);
2. ``config.py``          -- the ``wedge_guard`` section of
                             ``kv_transfer_config``, validated by field;
3. ``scheduler_side.py``  -- all of the guard's state (ledger, stats, router,
                             contained children's faults, receive-notice
                             filter), built only in the scheduler process;
4. ``connector.py``       -- ``WedgeGuardConnector``: a MultiConnector facade
                             that routes each hook and reports it to 3.;
5. ``scheduler.py``       -- the guarded schedulers: lateral preemption when
                             admission fails with nothing running;
6. ``routing.py``, ``containment.py``, ``stats.py``, ``metrics.py`` -- which
   child loads a request, children that raise, counters, Prometheus.

What differs between vLLM releases lives in ``vllm_mooncake/compat``.
Importing this package imports nothing else.
"""
