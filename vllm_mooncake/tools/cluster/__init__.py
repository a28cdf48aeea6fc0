"""Deployments of vLLM ranks running the wedge guard.

- :mod:`~vllm_mooncake.tools.cluster.local` -- a 1P2D / 2P2D cluster on 127.0.0.1
  (``python -m vllm_mooncake.tools.cluster.local up``, or ``deploy/local/up.sh``).
- :mod:`~vllm_mooncake.tools.cluster.layout` -- ports, CPU pinning and
  ``kv_transfer_config`` of each rank (no process handling, unit-tested).
- :mod:`~vllm_mooncake.tools.cluster.procs` -- start, health-wait and stop exactly
  the processes a run started.
- :mod:`~vllm_mooncake.tools.cluster.tiny_model` -- a tiny random Llama and an
  offline tokenizer, so the cluster runs on a CPU without downloads.
- :mod:`~vllm_mooncake.tools.cluster.mooncake_bootstrap` -- vLLM's Mooncake
  bootstrap server on an address we choose.
- :mod:`~vllm_mooncake.tools.cluster.client` -- the small HTTP client the CLI and the
  end-to-end tests use (completions, ``/metrics``).
"""
