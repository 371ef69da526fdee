"""Free loopback ports for the processes kvobs starts (testbed, Prometheus, tests)."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct currently-free TCP ports on 127.0.0.1 (racy, fine for local runs)."""
    sockets, ports = [], []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports


def free_port() -> int:
    return free_ports(1)[0]
