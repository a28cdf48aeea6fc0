"""Start, health-wait and stop exactly the processes one run started.

Every process is started in a new session (``start_new_session=True``), so
it and everything it forks (vLLM's engine core, its workers, the
multiprocessing resource tracker) share a session id equal to its pid. The
run's state file records each leader's pid *and* its start time
(``/proc/<pid>/stat`` field 22); ``stop`` signals only processes of that
session that started no earlier than the leader -- never a process that
reused a pid, never anything another run or user started.

Linux only (``/proc``), like vLLM's CPU backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"


class StartupError(RuntimeError):
    """A process died or did not become healthy; the message names it."""


@dataclass(frozen=True)
class Proc:
    name: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat starttime: tells a reused pid apart
    argv: list[str]
    log: str
    health_url: str

    def members(self) -> list[int]:
        """Live processes of this process's session (itself included)."""
        return [
            pid
            for pid, (session, ticks) in _proc_table().items()
            if session == self.pid and ticks >= self.start_ticks
        ]

    def leader_alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start_ticks


def _stat(pid: int) -> tuple[int, int] | None:
    """(session id, start time in clock ticks) of ``pid``, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp session ..." -- comm may hold spaces.
    fields = raw[raw.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # a zombie is gone for our purposes
    return int(fields[3]), int(fields[19])


def _proc_table() -> dict[int, tuple[int, int]]:
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                table[int(entry.name)] = stat
    return table


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: str | Path, lines: int = 30) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Run:
    """One run's folder: ``state.json`` and ``logs/<name>.log``."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir)
        self.logs = self.dir / "logs"
        self.state_path = self.dir / STATE_FILE
        self.procs: list[Proc] = []
        self.info: dict[str, Any] = {}
        if self.state_path.exists():
            self._load()

    # ---- state ----------------------------------------------------------------
    def _load(self) -> None:
        data = json.loads(self.state_path.read_text())
        self.info = data.get("info", {})
        self.procs = [Proc(**p) for p in data.get("procs", [])]

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        data = {"info": self.info, "procs": [asdict(p) for p in self.procs]}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.state_path)

    def live(self) -> list[Proc]:
        return [p for p in self.procs if p.members()]

    # ---- start ----------------------------------------------------------------
    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        health_url: str,
    ) -> Proc:
        """Start ``argv`` in its own session, logging to ``logs/<name>.log``."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            out.write(f"# {time.strftime('%F %T')} {' '.join(argv)}\n".encode())
            out.flush()
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=self.dir,
                start_new_session=True,
            )
        stat = _stat(popen.pid)
        proc = Proc(
            name=name,
            pid=popen.pid,
            start_ticks=stat[1] if stat else 0,
            argv=list(argv),
            log=str(log),
            health_url=health_url,
        )
        self.procs.append(proc)
        self.save()  # recorded before anything waits: `down` can always stop it
        return proc

    def wait_healthy(
        self, procs: Iterable[Proc], timeout: float, poll: float = 1.0
    ) -> float:
        """Wait until every ``health_url`` answers 200; return the seconds taken.

        Raises :class:`StartupError` with the log tail of the first process
        that exits, or of every process still unhealthy at the deadline.
        """
        t0 = time.monotonic()
        pending = list(procs)
        while pending:
            for p in list(pending):
                if http_ok(p.health_url):
                    pending.remove(p)
                elif not p.leader_alive():
                    raise StartupError(
                        f"{p.name} (pid {p.pid}) exited during start-up; "
                        f"log {p.log}:\n{tail(p.log)}"
                    )
            if not pending:
                break
            if time.monotonic() - t0 > timeout:
                names = ", ".join(p.name for p in pending)
                logs = "\n".join(f"--- {p.log}\n{tail(p.log, 10)}" for p in pending)
                raise StartupError(
                    f"not healthy after {timeout:.0f} s: {names}\n{logs}"
                )
            time.sleep(poll)
        return time.monotonic() - t0

    def _latest(self, name: str) -> Proc:
        """The latest start of the recorded process ``name``."""
        named = [p for p in self.procs if p.name == name]
        if not named:
            raise KeyError(f"no process {name!r} recorded in {self.state_path}")
        return named[-1]

    # ---- stop -----------------------------------------------------------------
    def stop_one(
        self, name: str, timeout: float = 30.0, sig: int = signal.SIGTERM
    ) -> list[str]:
        """Stop the recorded process ``name`` (``sig``, SIGTERM unless told:
        SIGKILL is a crash; then SIGKILL for what outlives ``timeout``); it
        stays recorded, so :meth:`stop` still reports it."""
        proc = self._latest(name)
        members = proc.members()
        for pid in members:
            _signal(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.members():
            time.sleep(0.2)
        report = [f"{name}: {signal.Signals(sig).name} to {len(members)} process(es)"]
        for pid in proc.members():
            _signal(pid, signal.SIGKILL)
            report.append(f"{name}: SIGKILL to {pid}")
        return report

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[list[int]]:
        """Freeze the recorded process ``name`` and everything of its session
        (SIGSTOP) for the ``with`` block, then let it go on (SIGCONT, also
        when the block raises). Its sockets stay open: a peer's connection is
        still accepted by the kernel, and waits."""
        members = self._latest(name).members()
        for pid in members:
            _signal(pid, signal.SIGSTOP)
        try:
            yield members
        finally:
            for pid in members:
                _signal(pid, signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> list[str]:
        """SIGTERM every process of every recorded session, SIGKILL stragglers.

        Returns one line per recorded process saying what happened. The
        state file is removed once nothing recorded is left.
        """
        report = []
        for proc in reversed(self.procs):
            members = proc.members()
            for pid in members:
                _signal(pid, signal.SIGTERM)
            report.append(
                f"{proc.name}: SIGTERM to {len(members)} process(es)"
                if members
                else f"{proc.name}: not running"
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.live():
            time.sleep(0.5)
        for proc in self.live():
            members = proc.members()
            for pid in members:
                _signal(pid, signal.SIGKILL)
            report.append(f"{proc.name}: SIGKILL to {len(members)} straggler(s)")
        time.sleep(0.2)
        if not self.live():
            self.state_path.unlink(missing_ok=True)
            self.procs = []
        return report


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, sig)
