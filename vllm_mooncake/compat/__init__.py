"""The compat wing: everything that depends on which vLLM runs, and where.

- ``versions.py``     -- the supported releases; anything else is refused at
                         start-up with the list;
- ``releases.py``     -- what differs between supported releases (waiting
                         queues, promotion hook, reservation terms), behind
                         one ``SchedulerAccess`` the guard uses;
- ``internals.py``    -- every private vLLM name the project touches, checked
                         by name in ``tests/test_internals.py`` and at
                         start-up;
- ``source_check.py`` -- the same list read from a release's source, for
                         releases that cannot run here;
- ``cpu.py``          -- patches for vLLM on hosts without an accelerator,
                         each with Why / How / Upstream / Removal, applied
                         from :func:`vllm_mooncake.plugin.register` only
                         where needed;
- ``servers.py``      -- what a real server of a release needs around it
                         (hash seeds, the Mooncake bootstrap).

Release-by-release facts: ``docs/vllm-scheduler-by-release.md``; where a
new release's differences go: ``docs/architecture.md``, section 5.
"""

__all__: list[str] = []  # the modules are the surface
