"""Test doubles and the real-scheduler driver, shared by tests and the simulator.

Importing this package changes nothing: the driver prepares the offline
environment (:mod:`vllm_mooncake.offline`) itself before it imports vLLM.
"""
