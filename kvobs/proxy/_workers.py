"""Several worker processes on one port (``--workers N``).

The supervisor (the process ``kvobs proxy`` started) forks N workers; each binds the
port with ``SO_REUSEPORT`` and the kernel spreads new connections over them. What the
workers share, and what each keeps:

- conversation state: Redis only. ``ProxyConfig`` refuses the in-memory store with
  N > 1: a connection lands on any worker, so a conversation is not pinned to one;
- metrics: each worker its own registry, served at its own port (``metrics_port`` +
  index, default ``port`` + 1 + index). The shared port's ``/metrics`` answers 404 and
  names those ports: a scrape there would read whichever worker the kernel picked, a
  counter that jumps between workers. Scrape every worker; sum in the query;
- spans: each worker its own exporter, appending to its own span store segment
  (``segments``: one active segment per writer pid, appends under ``flock``);
- the new-tenant admission window (``--max-new-tenants``) is per worker.

Stopping: SIGTERM or SIGINT to the supervisor is sent on to each worker by PID; a worker
that exits by itself (a failure) makes the supervisor stop the others and exit 1. A
worker whose supervisor dies gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import time
from typing import Callable

from aiohttp import web

from kvobs.proxy._log import log
from kvobs.proxy.config import ProxyConfig

_LOG = logging.getLogger("kvobs.proxy")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A worker not gone this long after SIGTERM (its in-flight turns had their chance)
# is killed.
STOP_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1


def worker_metrics_port(config: ProxyConfig, index: int) -> int:
    """Where worker ``index`` serves its own ``/metrics``.

    >>> from kvobs.proxy.config import Endpoint
    >>> e = (Endpoint("p", 1),)
    >>> worker_metrics_port(ProxyConfig(e, e, port=8000), 1)
    8002
    >>> worker_metrics_port(ProxyConfig(e, e, port=8000, metrics_port=9100), 1)
    9101
    """
    first = config.metrics_port if config.metrics_port is not None else config.port + 1
    return first + index


async def _serve(app: web.Application, metrics: web.Application, config, index, options):
    runner = web.AppRunner(app, access_log=None, **options)
    metrics_runner = web.AppRunner(metrics, access_log=None)
    await runner.setup()
    await metrics_runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in _STOP_SIGNALS:
        loop.add_signal_handler(signum, stop.set)
    try:
        await web.TCPSite(runner, config.host, config.port, reuse_port=True).start()
        port = worker_metrics_port(config, index)
        await web.TCPSite(metrics_runner, config.host, port).start()
        log(_LOG, logging.INFO, "worker serving", worker=index, pid=os.getpid(), metrics_port=port)
        await stop.wait()
    finally:
        await metrics_runner.cleanup()
        await runner.cleanup()


def _worker(config: ProxyConfig, index: int, build: Callable, options: dict) -> int:
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    try:  # the supervisor gone (killed), the worker goes too
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass
    try:
        app, metrics = build(config)
        gc.collect()
        gc.freeze()
        asyncio.run(_serve(app, metrics, config, index, options))
    except Exception:  # noqa: BLE001 - reported; the supervisor stops the others
        _LOG.exception("worker failed")
        return 1
    return 0


def run_workers(config: ProxyConfig, build: Callable, options: dict) -> int:
    """Fork ``config.workers`` workers (``build(config)``: the proxy's application and
    its metrics-only application) and wait on them; the exit status to leave with."""
    stopping = False
    alive: set[int] = set()  # forked and not yet reaped: a reaped PID may be reused

    def stop(_signum=None, _frame=None) -> None:
        nonlocal stopping
        stopping = True
        for pid in alive:
            os.kill(pid, signal.SIGTERM)

    # Set before forking: a SIGTERM between two forks still reaches the workers so far.
    for signum in _STOP_SIGNALS:
        signal.signal(signum, stop)
    for index in range(config.workers):
        pid = os.fork()
        if pid == 0:
            os._exit(_worker(config, index, build, options))
        alive.add(pid)
    log(
        _LOG,
        logging.INFO,
        "workers started",
        workers=config.workers,
        pids=",".join(map(str, sorted(alive))),
        metrics_ports=",".join(str(worker_metrics_port(config, i)) for i in range(config.workers)),
    )
    status, deadline = 0, None
    while alive:
        for pid in list(alive):
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            alive.discard(pid)
            code = os.waitstatus_to_exitcode(wait_status)
            if not stopping:
                log(_LOG, logging.ERROR, "worker exited; stopping the others", pid=pid, code=code)
                status = 1
                stop()
            elif code not in (0, -signal.SIGTERM):
                status = 1
        if stopping and deadline is None:
            deadline = time.monotonic() + STOP_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.1)
    return status
