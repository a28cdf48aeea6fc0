"""Which addresses a set of processes listens on (Linux ``/proc``, no tools).

A *listening* socket is a TCP socket in state LISTEN, or a UDP socket with no
peer (it takes datagrams from anyone who can reach its address). Each is
found in the kernel's tables (``/proc/net/{tcp,tcp6,udp,udp6}``, read through
the process's own network namespace) and tied to a process by its inode in
``/proc/<pid>/fd``. :func:`listening` lists them for the processes a local
cluster run started (and their descendants); :func:`exposed` keeps the ones
any host but this one could reach (not bound to loopback).

::

    python -m vllm_mooncake.tools.cluster.sockets [--run NAME]   # exit 1 if exposed
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

TCP_LISTEN = "0A"
UDP_UNCONNECTED = "07"  # TCP_CLOSE in the UDP table: bound, no peer
TABLES = (("tcp", "tcp"), ("tcp6", "tcp"), ("udp", "udp"), ("udp6", "udp"))


@dataclass(frozen=True)
class Listener:
    """One listening socket of one process."""

    proto: str  # "tcp" | "udp"
    address: str  # "127.0.0.1", "0.0.0.0", "::", "::1", ...
    port: int
    pid: int
    process: str  # the process's name (``/proc/<pid>/comm``)
    owner: str  # the run's name for the process tree it belongs to

    @property
    def loopback(self) -> bool:
        """Bound to a loopback address (127.0.0.0/8, ::1, ::ffff:127.x)."""
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        where = f"{self.proto} {host}:{self.port}"
        return f"{self.owner}: {self.process} (pid {self.pid}) {where}"


def decode_address(hex_addr: str) -> str:
    """An address as ``/proc/net/tcp*`` writes it (host-order 32-bit words).

    >>> decode_address("0100007F")
    '127.0.0.1'
    >>> decode_address("00000000000000000000000001000000")
    '::1'
    """
    raw = bytes.fromhex(hex_addr)
    if len(raw) not in (4, 16):
        raise ValueError(f"address {hex_addr!r}: expected 8 or 32 hex digits")
    # Each 32-bit word is in the kernel's (little-endian) byte order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def parse_table(text: str, proto: str) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of the listening sockets in one table."""
    out: dict[int, tuple[str, int]] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
        if proto == "tcp" and state != TCP_LISTEN:
            continue
        if proto == "udp" and (state != UDP_UNCONNECTED or _port(remote) != 0):
            continue
        host, _, port = local.partition(":")
        out[inode] = (decode_address(host), int(port, 16))
    return out


def _port(hex_endpoint: str) -> int:
    return int(hex_endpoint.rpartition(":")[2], 16)


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets ``pid`` holds open (empty if it is gone)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return set()
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def descendants(roots: Iterable[int]) -> set[int]:
    """``roots`` and every live process below them (by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    seen: set[int] = set()
    todo = [p for p in roots if Path(f"/proc/{p}").exists()]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return seen


def listening(owners: dict[str, Iterable[int]]) -> list[Listener]:
    """Every listening socket held by the processes of each owner.

    ``owners`` maps a name (``prefill-0``, ``router``...) to its processes;
    their descendants count too. A socket two processes share (inherited
    over ``fork``) is listed once per process.
    """
    found: list[Listener] = []
    for owner, pids in owners.items():
        for pid in sorted(descendants(pids)):
            inodes = socket_inodes(pid)
            if not inodes:
                continue
            for table, proto in TABLES:
                try:
                    text = Path(f"/proc/{pid}/net/{table}").read_text()
                except OSError:
                    continue
                for inode, (addr, port) in parse_table(text, proto).items():
                    if inode in inodes:
                        found.append(Listener(proto, addr, port, pid, comm(pid), owner))
    return sorted(set(found), key=lambda s: (s.owner, s.pid, s.proto, s.port))


def exposed(listeners: Iterable[Listener]) -> list[Listener]:
    """The listeners not bound to a loopback address."""
    return [s for s in listeners if not s.loopback]


def run_listeners(run_dir: Path) -> list[Listener]:
    """The listening sockets of every process a local cluster run started
    (the run whose ``state.json`` is in ``run_dir``), by process name."""
    from vllm_mooncake.tools.cluster.procs import Run

    state = Run(run_dir)
    return listening({p.name: p.members() for p in state.procs})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="List the listening sockets of a local cluster run."
    )
    parser.add_argument("--run", default="local")
    args = parser.parse_args(argv)
    from vllm_mooncake.tools.cluster.local import run_dir

    found = run_listeners(run_dir(args.run))
    if not found:
        print(f"run {args.run!r}: no listening socket (is it up?)")
        return 1
    for s in found:
        print(f"{'loopback' if s.loopback else 'EXPOSED '} {s}")
    return 1 if exposed(found) else 0


if __name__ == "__main__":
    sys.exit(main())
