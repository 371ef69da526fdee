"""Free loopback ports for the processes kvobs starts (testbed, Prometheus, tests)."""

from __future__ import annotations

import random
import socket

_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 20000


def _below_ephemeral() -> range | None:
    """Ports below the kernel's ephemeral range. A port the kernel hands out for bind(0)
    is also one it hands to the next outgoing connection (vLLM's ZMQ sockets, HTTP
    clients): between our pick and the server's bind, another process may take it."""
    try:
        with open(_EPHEMERAL_RANGE, encoding="ascii") as handle:
            low = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(_LOWEST, low) if low - _LOWEST >= 1000 else None


def free_ports(n: int) -> list[int]:
    """``n`` distinct currently-free TCP ports on 127.0.0.1, outside the ephemeral range
    where the kernel allows (still racy between processes picking at once, but no longer
    with ordinary outgoing connections)."""
    candidates = _below_ephemeral()
    rng = random.Random()
    sockets, ports = [], []
    try:
        attempts = 0
        while len(ports) < n:
            attempts += 1
            sock = socket.socket()
            port = rng.choice(candidates) if candidates and attempts < 50 * n else 0
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports


def free_port() -> int:
    return free_ports(1)[0]
