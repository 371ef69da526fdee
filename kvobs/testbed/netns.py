"""A real slow link between P and D: D runs in its own network namespace behind a veth
pair, UCX goes over TCP, and ``tc`` shapes that link (tbf rate limit, netem delay).
Needs root and iproute2 (scripts/setup.sh installs it)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {done.stderr.strip()}")


@dataclass
class LinkNamespace:
    name: str
    outer_if: str
    inner_if: str
    outer_address: str
    inner_address: str

    @classmethod
    def create(cls) -> "LinkNamespace":
        suffix = os.getpid() % 100000
        subnet = 16 + suffix % 200
        link = cls(
            f"kvobs-d-{suffix}",
            f"kvo{suffix}",
            f"kvi{suffix}",
            f"10.213.{subnet}.1",
            f"10.213.{subnet}.2",
        )
        try:
            _ip("ip", "netns", "add", link.name)
            _ip("ip", "link", "add", link.outer_if, "type", "veth", "peer", "name", link.inner_if)
            _ip("ip", "link", "set", link.inner_if, "netns", link.name)
            _ip("ip", "addr", "add", f"{link.outer_address}/30", "dev", link.outer_if)
            _ip("ip", "link", "set", link.outer_if, "up")
            _ip("ip", "addr", "add", f"{link.inner_address}/30", "dev", link.inner_if, ns=link.name)
            _ip("ip", "link", "set", link.inner_if, "up", ns=link.name)
            _ip("ip", "link", "set", "lo", "up", ns=link.name)
        except (NetnsError, OSError, subprocess.TimeoutExpired):
            link.stop()
            raise
        return link

    @property
    def wrapper(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.name)

    def shape(self, delay_ms: float, rate_mbit: float) -> None:
        """Shape both ends: D->P carries the KV, P->D the read requests.

        A rate limit uses ``tbf`` (always in the kernel); a delay needs ``netem``, which
        some kernels (this sandbox's among them) lack: then a clear error, not a silent
        unshaped link.
        """
        if delay_ms > 0:
            qdisc = ["netem", "delay", f"{delay_ms}ms"]
            if rate_mbit > 0:
                qdisc += ["rate", f"{rate_mbit}mbit"]
        elif rate_mbit > 0:
            burst_kbit = max(32, int(rate_mbit * 1000 / 100))  # 10 ms worth of bytes
            qdisc = [
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                f"{burst_kbit}kbit",
                "latency",
                "2s",
            ]
        else:
            qdisc = ["pfifo"]
        for device, ns in ((self.outer_if, None), (self.inner_if, self.name)):
            try:
                _ip("tc", "qdisc", "replace", "dev", device, "root", *qdisc, ns=ns)
            except NetnsError as error:
                if "unknown" in str(error) and qdisc[0] == "netem":
                    raise NetnsError(
                        "link_delay_ms needs the kernel's netem qdisc, which "
                        "this machine lacks; use link_rate_mbit (tbf)"
                    ) from None
                raise

    def stop(self) -> None:
        # Deleting the namespace deletes the veth pair with it.
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=15)
        subprocess.run(["ip", "link", "del", self.outer_if], capture_output=True, timeout=15)
