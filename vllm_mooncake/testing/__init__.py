"""Test doubles and the real-scheduler driver, shared by tests and the simulator.

Importing this package prepares an offline environment (project-local vLLM
cache, no hub access) before vLLM is imported.
"""

from vllm_mooncake.testing.offline import prepare_offline_env

prepare_offline_env()

__all__ = ["prepare_offline_env"]
