"""What a store call costs in Redis time: from each command's send to its reply's arrival.

A turn's Redis budget (``StoreGuard``) must measure Redis, not the proxy's own event
loop. Under load (256 clients on one saturated core) a call's wall time is mostly the
loop's queue: getting a pooled connection, and, once the reply is in, waiting for the
task to be resumed behind every other ready callback, once per ``await`` inside the
client. Charged to Redis, that lag made turns give up on a healthy Redis (#10).

``CallMeter`` counts only the time during which a command is outstanding: from the
moment its bytes are written to the socket to the moment its reply reached the kernel
(TCP on Linux: ``tcpi_last_data_recv`` of ``TCP_INFO``, read when the loop hands the
bytes to the connection's stream reader, ``feed_data``). Neither the loop's lag nor the
proxy process being descheduled on a busy host is counted. Elsewhere (a Unix socket) the
reply's time is when the loop hands it over: at most two loop iterations of lag remain.
A hung Redis still costs wall time: no reply arrives, so an outstanding command is
charged until now.

Connecting counts too: from the connect call to the handshake's SYN-ACK (``tcpi_last_ack_recv``).

``timed_connection_class`` makes any redis-py asyncio connection class (TCP, TLS, Unix)
report to the meter of the guarded call that sent the command (a context variable set by
``StoreGuard.call`` for the duration of its call).
"""

from __future__ import annotations

import contextvars
import functools
import socket
import struct
import time
from typing import Any, Callable

METER: contextvars.ContextVar["CallMeter | None"] = contextvars.ContextVar(
    "kvobs_store_meter", default=None
)


class CallMeter:
    """Redis time of one guarded call: finished round trips plus the outstanding one."""

    __slots__ = ("charged", "_since", "_answered")

    def __init__(self):
        self.charged = 0.0
        self._since: float | None = None  # perf_counter of the send (or last bytes)
        self._answered = False

    def sent(self, now: float) -> None:
        if self._since is None:
            self._since = now
            self._answered = False

    def arrived(self, now: float) -> None:
        if self._since is not None:
            self.charged += max(0.0, now - self._since)
            self._since = now  # a reply in several reads: the gaps are Redis's too
            self._answered = True

    def done(self, now: float) -> None:
        """The command's reply was read, or its wait ended without one (cancelled,
        failed): then the whole wait since the send was Redis's."""
        if self._since is not None and not self._answered:
            self.charged += now - self._since
        self._since = None

    def used(self, now: float) -> float:
        """Seconds charged so far, counting an outstanding command until ``now``."""
        if self._since is None or self._answered:
            return self.charged
        return self.charged + now - self._since


_TCP_INFO = getattr(socket, "TCP_INFO", None)  # Linux
_U32 = struct.Struct("=I")
# struct tcp_info (linux/tcp.h): 8 one-byte fields, then u32s; ms since the last...
_LAST_DATA_RECV_AT = 52  # ...data segment received (tcpi_last_data_recv)
_LAST_ACK_RECV_AT = 56  # ...ACK received (tcpi_last_ack_recv): a new connection's SYN-ACK


def _kernel_clock(sock: Any, offset: int) -> Callable[[], float]:
    """When the kernel last received data (or an ACK) on ``sock``, on this process's
    perf_counter.

    For TCP on Linux, from ``TCP_INFO``'s ms-since fields: neither the loop's queue nor
    the proxy process being descheduled (a busy host) is counted. Elsewhere (a Unix
    socket), the time of the call, which includes whatever lag the caller had."""
    if _TCP_INFO is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return time.perf_counter

    def received_at() -> float:
        now = time.perf_counter()
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, offset + 4)
            (ago_ms,) = _U32.unpack_from(info, offset)
        except (OSError, struct.error):
            return now
        return now - ago_ms / 1000.0

    return received_at


class _TimedMixin:
    """Stamps sends and reply arrivals on the sending call's ``CallMeter``."""

    _kvobs_meter: CallMeter | None = None

    async def _connect(self) -> None:
        meter = METER.get()
        if meter is not None:  # a connection that does not open is Redis's time too
            meter.sent(time.perf_counter())
        try:
            await super()._connect()  # type: ignore[misc]
            sock = self._writer.transport.get_extra_info("socket")  # type: ignore[attr-defined]
            if meter is not None:  # open when the SYN-ACK came
                meter.arrived(_kernel_clock(sock, _LAST_ACK_RECV_AT)())
        finally:
            if meter is not None:
                meter.done(time.perf_counter())
        reader = self._reader  # type: ignore[attr-defined]
        feed = reader.feed_data
        arrival = _kernel_clock(sock, _LAST_DATA_RECV_AT)

        def feed_data(data: Any, _feed=feed) -> None:
            meter = self._kvobs_meter
            if meter is not None:
                meter.arrived(arrival())
            _feed(data)

        # An instance attribute: the stream protocol calls reader.feed_data(data).
        reader.feed_data = feed_data

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        meter = METER.get()
        self._kvobs_meter = meter
        if meter is None:
            return await super().send_packed_command(command, check_health)  # type: ignore[misc]
        if not self.is_connected:  # type: ignore[attr-defined]
            # Connecting sends its own commands (CLIENT SETINFO): charged the same way.
            await self.connect_check_health(check_health=False)  # type: ignore[attr-defined]
            self._kvobs_meter = meter
        if not self.socket_timeout:  # type: ignore[attr-defined]
            meter.sent(time.perf_counter())  # written below, at once
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except BaseException:
            meter.done(time.perf_counter())
            raise

    async def _send_packed_command(self, command: Any) -> None:
        # With a socket timeout redis-py writes in a task of its own (wait_for): a loop
        # iteration later, which is not Redis's time either.
        meter = self._kvobs_meter
        if meter is not None:
            meter.sent(time.perf_counter())
        await super()._send_packed_command(command)  # type: ignore[misc]

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        finally:
            meter = self._kvobs_meter
            if meter is not None:
                meter.done(time.perf_counter())
                self._kvobs_meter = None


@functools.lru_cache(maxsize=None)
def timed_connection_class(cls: type) -> type:
    """``cls`` with its Redis time reported to the current ``CallMeter``."""
    return type(f"Timed{cls.__name__}", (_TimedMixin, cls), {})
