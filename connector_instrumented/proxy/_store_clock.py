"""What a store call costs in Redis time: from each command's send to its reply's arrival.

A turn's Redis budget (``StoreGuard``) must measure Redis, not the proxy's own event
loop. Under load (256 clients on one saturated core) a call's wall time is mostly the
loop's queue: getting a pooled connection, and, once the reply is in, waiting for the
task to be resumed behind every other ready callback, once per ``await`` inside the
client. Charged to Redis, that lag made turns give up on a healthy Redis (#10).

``CallMeter`` counts only the time during which a command is outstanding: from the
moment its bytes are written to the socket to the loop's poll (``select``) that saw the
reply (stamped by ``_stamp_polls`` on selector loops; elsewhere, when the loop hands the
bytes to the connection's stream reader). What is left of the loop's lag is at most one
loop iteration per reply (the bytes may sit in the socket while the loop ends the
iteration in which it sent), against several before. A hung Redis still costs wall time: no reply arrives, so an outstanding command
is charged until now.

Connecting counts the same way (from the connect call to the poll that saw it open).

``timed_connection_class`` makes any redis-py asyncio connection class (TCP, TLS, Unix)
report to the meter of the guarded call that sent the command (a context variable set by
``StoreGuard.call`` for the duration of its call).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from typing import Any

METER: contextvars.ContextVar["CallMeter | None"] = contextvars.ContextVar(
    "kvobs_store_meter", default=None)


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


def _stamp_polls(loop: Any) -> None:
    """Note on ``loop`` when its selector last returned: the reads a poll reports run
    later in the same iteration, behind every callback already queued."""
    selector = getattr(loop, "_selector", None)  # selector event loops (not uvloop)
    if selector is None or hasattr(selector, "kvobs_polled_at"):
        return
    select = selector.select

    def stamped(timeout: float | None = None) -> Any:
        events = select(timeout)
        selector.kvobs_polled_at = time.perf_counter()
        return events

    selector.kvobs_polled_at = time.perf_counter()
    selector.select = stamped


def _arrival_clock(loop: Any):
    selector = getattr(loop, "_selector", None)
    if selector is None or not hasattr(selector, "kvobs_polled_at"):
        return time.perf_counter
    return lambda: selector.kvobs_polled_at


class _TimedMixin:
    """Stamps sends and reply arrivals on the sending call's ``CallMeter``."""

    _kvobs_meter: CallMeter | None = None

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        _stamp_polls(loop)
        arrival = _arrival_clock(loop)
        meter = METER.get()
        if meter is not None:  # a connection that does not open is Redis's time too
            meter.sent(time.perf_counter())
        try:
            await super()._connect()  # type: ignore[misc]
            if meter is not None:
                meter.arrived(arrival())
        finally:
            if meter is not None:
                meter.done(time.perf_counter())
        reader = self._reader  # type: ignore[attr-defined]
        feed = reader.feed_data

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
