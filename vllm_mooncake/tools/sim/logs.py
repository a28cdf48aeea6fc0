"""Keep vLLM's and the guard's log lines out of the simulator's output.

vLLM 0.32 configures its loggers only when an engine starts, so a process
that drives the scheduler directly gets every INFO line on stderr through
Python's last-resort handler. The simulator prints tables; the guard's
per-preemption WARNING lines and wedge alarms are counted in the result
instead (``--verbose`` shows them).
"""

from __future__ import annotations

import logging

QUIET_LOGGERS = ("vllm", "vllm_mooncake")


def quiet_vllm(level: int = logging.CRITICAL) -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(level)
