"""Free loopback ports for the processes kvobs starts (testbed, Prometheus, tests)."""

from __future__ import annotations

import random
import socket
import threading

_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 20000

# Ports this process handed out and may not have bound yet: two servers in one harness
# each pick a port before either binds, so a random pick must not repeat a recent one
# (CI lost a run to two stand-ins drawing the same port out of ~12,000).
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
_REMEMBERED = 4096


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
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        attempts = 0
        while len(ports) < n:
            attempts += 1
            sock = socket.socket()
            port = rng.choice(candidates) if candidates and attempts < 50 * n else 0
            if port in _handed_out or port in ports:
                sock.close()
                continue
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            bound = sock.getsockname()[1]
            if bound in _handed_out or bound in ports:  # bind(0) may repeat one too
                sockets.append(sock)  # held until the end, so the next bind(0) moves on
                continue
            sockets.append(sock)
            ports.append(bound)
    finally:
        for sock in sockets:
            sock.close()
    with _handed_out_lock:
        if len(_handed_out) > _REMEMBERED:
            _handed_out.clear()
        _handed_out.update(ports)
    return ports


def free_port() -> int:
    return free_ports(1)[0]
