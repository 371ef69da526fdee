"""Bounded metadata-store calls: a per-turn time budget and a circuit breaker.

A slow or hung Redis (SIGSTOP, a full network queue) must cost a turn at most
``budget_s`` of Redis time in all, after which the turn goes on without reuse and says so
(``kvobs.proxy.store_failure`` on its lookup/store span,
``kvobs_proxy_store_degraded_total{reason}``). After ``failures`` failed calls in a row
the breaker opens: calls are skipped (``circuit-open``, no cost) for ``cooldown_s``, then
one call probes; its success closes the breaker, its failure opens it again.

The budget is charged with Redis time (``_store_clock``: from each command's write, or a
connection's opening, to the moment the reply reached the kernel), not with the wall
time of the call, which under load is mostly the proxy's own event loop (and, on a busy
host, the proxy process waiting for a CPU). What Redis time does not see is a wait for a
pooled connection, bounded by the calls holding them (each bounded by its budget); as a
safety net a call also ends after ``WALL_FACTOR`` times the budget of wall time (10 s at
the default 0.5 s: past what an overloaded loop takes, so it does not turn the loop's
lag into lost reuse).

The in-process memory store is not bounded: its calls cannot hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from kvobs import semconv as sc

from kvobs.proxy._log import log
from kvobs.proxy._metrics import ProxyMetrics
from kvobs.proxy._store_clock import METER, CallMeter

_LOG = logging.getLogger("kvobs.proxy")
SF = sc.StoreFailure
WALL_FACTOR = 20.0
_RECANCEL_S = 0.01


class Budget:
    """Seconds a turn may still spend waiting on the store."""

    __slots__ = ("left",)

    def __init__(self, seconds: float):
        self.left = seconds


class StoreGuard:
    def __init__(
        self,
        metrics: ProxyMetrics,
        backend: str,
        bounded: bool,
        budget_s: float,
        failures: int,
        cooldown_s: float,
    ):
        self._metrics = metrics
        self._backend = backend
        self.bounded = bounded
        self.budget_s = budget_s
        self._max_failures = failures
        self._cooldown_s = cooldown_s
        self._failures = 0  # in a row
        self._open_until: float | None = None  # monotonic; None: closed
        self._probing = False

    def budget(self) -> Budget:
        return Budget(self.budget_s)

    @property
    def open(self) -> bool:
        return self._open_until is not None

    async def call(
        self, budget: Budget, fn: Callable[..., Awaitable[Any]], *args: Any, extra_s: float = 0.0
    ) -> tuple[Any, sc.StoreFailure | None]:
        """``(fn(*args), None)``, or ``(None, why)`` when the store gave no answer.

        ``extra_s``: time the call waits by design (the params publisher's poll between
        its commands): not Redis time, so not charged; it extends the wall bound. Never
        raises (but cancellation)."""
        probe = False
        if self.bounded:
            if self._open_until is not None:
                if self._probing or time.monotonic() < self._open_until:
                    return self._skip(SF.CIRCUIT_OPEN)
                probe = self._probing = True
            if budget.left <= 0:
                if probe:
                    self._probing = False
                return self._skip(SF.BUDGET_SPENT)
        meter = CallMeter()
        token = METER.set(meter)
        failure = None
        value = None
        try:
            if self.bounded:
                value = await self._bounded(meter, budget.left, extra_s, fn, *args)
            else:
                value = await fn(*args)
        except TimeoutError:
            failure = SF.TIMEOUT
        except Exception as error:  # noqa: BLE001 - the store never breaks serving
            log(
                _LOG,
                logging.DEBUG,
                "metadata store call failed",
                backend=self._backend,
                error=f"{type(error).__name__}: {error}",
            )
            failure = SF.ERROR
        finally:
            METER.reset(token)
            if self.bounded:
                budget.left -= meter.used(time.perf_counter())
                if probe:
                    self._probing = False
        if failure is None:
            if self._failures or self._open_until is not None:
                self._close()
            return value, None
        self._metrics.store_errors.labels(self._backend).inc()
        self._metrics.store_degraded.labels(failure.value).inc()
        if self.bounded:
            self._failed(probe)
        return None, failure

    async def _bounded(
        self,
        meter: CallMeter,
        left: float,
        extra_s: float,
        fn: Callable[..., Awaitable[Any]],
        *args: Any,
    ) -> Any:
        """``await fn(*args)``, ended (TimeoutError) once ``meter`` reaches ``left`` or
        the wall time ``WALL_FACTOR * budget_s + extra_s``.

        Not ``asyncio.timeout``: on Python 3.11 redis-py's ``wait_for`` (socket writes)
        swallows a cancellation that lands as its inner task completes, and the timeout
        then never ends the call; here an expired call is cancelled again until it ends."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        started = time.perf_counter()
        wall_s = WALL_FACTOR * self.budget_s + extra_s
        cancels = 0
        handle: asyncio.TimerHandle

        def check() -> None:
            nonlocal handle, cancels
            now = time.perf_counter()
            wait = min(left - meter.used(now), wall_s - (now - started))
            if wait <= 0:
                cancels += 1
                task.cancel()
                wait = _RECANCEL_S
            handle = loop.call_later(wait, check)  # re-armed: the loop's lag is not Redis's

        handle = loop.call_later(min(left, wall_s), check)
        try:
            value = await fn(*args)
        except asyncio.CancelledError:
            if not cancels:
                raise
            for _ in range(cancels):
                task.uncancel()
            if task.cancelling():  # cancelled from outside as well
                raise
            raise TimeoutError from None
        finally:
            handle.cancel()
        for _ in range(cancels):  # a cancellation swallowed below: the answer came
            task.uncancel()
        return value

    def _skip(self, why: sc.StoreFailure) -> tuple[None, sc.StoreFailure]:
        self._metrics.store_degraded.labels(why.value).inc()
        return None, why

    def _failed(self, probe: bool) -> None:
        self._failures += 1
        if probe or (self._open_until is None and self._failures >= self._max_failures):
            if self._open_until is None:
                self._metrics.store_circuit_opened.inc()
                self._metrics.store_circuit_open.set(1)
                log(
                    _LOG,
                    logging.WARNING,
                    "metadata store failing: circuit open, skipped for the cool-down",
                    backend=self._backend,
                    failures=self._failures,
                    cooldown_s=self._cooldown_s,
                )
            self._open_until = time.monotonic() + self._cooldown_s

    def _close(self) -> None:
        if self._open_until is not None:
            log(
                _LOG,
                logging.WARNING,
                "metadata store answers again: circuit closed",
                backend=self._backend,
            )
            self._metrics.store_circuit_open.set(0)
        self._failures = 0
        self._open_until = None
