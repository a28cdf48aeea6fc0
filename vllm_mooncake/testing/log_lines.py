"""The shapes of the guard's log lines, as a vLLM server prints them.

One definition for the two places that must agree: docs/runbook.md shows
each line from a real server (``tests/test_runbook_lines.py`` matches the
runbook's examples against these shapes), and the end-to-end tier finds
them in real servers' logs (``tests/e2e/``). A line that changes its words
in the code fails both until the runbook follows.

Every line carries vLLM's prefix: the process and pid, the level, the time,
and ``[file.py:line]`` -- the guard's loggers sit under vLLM's ``vllm``
logger (``vllm_mooncake.LOGGER_ROOT``), whose handler writes that format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

VLLM_PREFIX = (
    r"\((?:EngineCore(?:_DP\d+)?|APIServer|Worker) pid=\d+\) {level} "
    r"\d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] "
)


@dataclass(frozen=True)
class LogLine:
    """One kind of guard line: its level and the shape of its message."""

    name: str
    level: str
    body: str  # a regular expression for the message

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(VLLM_PREFIX.format(level=self.level) + self.body)

    def search(self, text: str) -> re.Match[str] | None:
        return self.pattern.search(text)


START = LogLine(
    "start",
    "INFO",
    r"wedge guard active: WedgeGuard(?:Async)?Scheduler over \[[^\]]+\]; "
    r"policy=\S+ max_attempts=\d+ ",
)
LATERAL = LogLine(
    "lateral preemption",
    "WARNING",
    r"wedge guard: admission failed with nothing running; lateral preemption "
    r"of \S+ \((?:recv_done|promoted_idle), owner=\w+, \d+ blocks\) for \S+; "
    r"waiting holders now: ",
)
ALARM = LogLine(
    "wedge alarm",
    "ERROR",
    r"wedge alarm: no token scheduled for \d+ steps \([\d.]+ s\) while \d+ "
    r"waiting request\(s\) hold \d+ KV blocks, none runs and no receive is in "
    r"flight; policy=\S+; holders: ",
)
LOAD_RETRY_CUTOFF = LogLine(
    "load retry cut-off",
    "WARNING",
    r"request \S+: \d+ loads from \w+ failed \(max_failed_loads=\d+\); "
    r"computing it locally instead of loading it again",
)
RESERVATION_DROPPED = LogLine(
    "reservation dropped",
    "INFO",
    r"wedge guard: \S+ reserved blocks against its own admission after a "
    r"failed load; reservation dropped",
)
RECEIVE_FAILED = LogLine(
    "receive failed",
    "WARNING",
    r"wedge guard failed request \S+'s KV receive from \S+: "
    r"(?:deadline|sender_dead) after [\d.]+ s in flight \(sender .+\); "
    r"kv_load_failure_policy=\w+ decides; \d+ block\(s\) quarantined",
)
QUARANTINE_RELEASED = LogLine(
    "quarantine released",
    "INFO",
    r"wedge guard released \d+ quarantined KV block\(s\) of request \S+: "
    r"(?:transfer_ended|sender_dead)",
)
STUCK = LogLine(
    "stuck",
    "WARNING",
    r"wedge guard: no token scheduled for [\d.]+ s while requests wait "
    r"\(recv_deadline_s=[\d.]+\); this rank reports itself stuck "
    r"\(vllm:kv_guard_stuck=1\)",
)
NOT_STUCK = LogLine(
    "not stuck",
    "INFO",
    r"wedge guard: (?:tokens scheduled again|no request left); this rank is "
    r"not stuck",
)
RUNBOOK_LINES = (
    START,
    LATERAL,
    ALARM,
    LOAD_RETRY_CUTOFF,
    RESERVATION_DROPPED,
    RECEIVE_FAILED,
    QUARANTINE_RELEASED,
    STUCK,
    NOT_STUCK,
)

__all__ = [
    "ALARM",
    "LATERAL",
    "LOAD_RETRY_CUTOFF",
    "QUARANTINE_RELEASED",
    "RECEIVE_FAILED",
    "RESERVATION_DROPPED",
    "RUNBOOK_LINES",
    "START",
    "STUCK",
    "VLLM_PREFIX",
    "LogLine",
    "NOT_STUCK",
]
