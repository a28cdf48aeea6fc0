"""Compatibility patches for vLLM on platforms the guard's users run.

Each patch documents Why / How / Upstream / Removal and is applied from
:func:`vllm_mooncake.plugin.register` only where it is needed.
"""
