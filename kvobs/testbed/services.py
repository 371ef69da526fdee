"""Small helper processes the testbed and tests start and stop by PID: Redis, the proxy
(or vLLM's router in its place), the OTLP receiver."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvobs import semconv as sc
from kvobs._proc import stop_process_group, yield_cpu
from kvobs.testbed.engines import REPO_ROOT, free_ports


ROUND_ROBIN = "round_robin"  # vllm-router's --policy the testbed runs unless told


class ServiceError(RuntimeError):
    pass


class Process:
    """A child in its own session, logged to a file, stopped by PID (group) always."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict | None = None):
        self.name, self.cmd, self.log_path = name, cmd, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"# cmd: {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(REPO_ROOT),
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 5.0) -> None:
        stop_process_group(self.proc, grace_s)

    def crash(self) -> None:
        """SIGKILL: the child gets no chance to finish anything (its stop hooks)."""
        stop_process_group(self.proc, crash=True)

    def wait_until(self, probe, timeout_s: float, what: str) -> None:
        """Return once ``probe()``; else stop the child (its constructor fails, so no
        caller holds it to stop later) and raise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                self.stop()  # its process group may outlive it
                raise ServiceError(f"{self.name} exited during start-up:\n{self.log_tail()}")
            if probe():
                return
            time.sleep(0.1)
        self.stop()
        raise ServiceError(f"{self.name} not {what} after {timeout_s}s:\n{self.log_tail()}")


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


class RedisServer(Process):
    """A real ``redis-server`` on a free loopback port, data in ``directory``."""

    def __init__(self, directory: Path, port: int | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceError("redis-server not installed (scripts/setup.sh installs it)")
        self.port = port or free_ports(1)[0]
        directory.mkdir(parents=True, exist_ok=True)
        super().__init__(
            "redis",
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(directory),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ],
            directory / "redis.log",
        )
        self.wait_until(lambda: _port_open("127.0.0.1", self.port), 10, "listening")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class FrontDoor(Process):
    """What the client talks to in front of P and D, on ``port``: healthy when its
    ``/health`` answers 200."""

    port: int

    def __init__(
        self, name: str, cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None
    ):
        super().__init__(name, cmd, log_path, env)
        self.wait_until(lambda: _http_ok(f"{self.url}/health"), timeout_s, "healthy")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"


class ProxyProcess(FrontDoor):
    """``kvobs proxy`` as a child process writing spans to ``store_dir``."""

    def __init__(
        self,
        log_path: Path,
        *,
        prefill: str,
        decode: str,
        store_dir: str,
        port: int | None = None,
        redis_url: str | None = None,
        extra_args: list[str] | None = None,
        env: dict | None = None,
    ):
        self.port = port or free_ports(1)[0]
        cmd = [
            sys.executable,
            "-m",
            "kvobs",
            "proxy",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prefiller-hosts",
            prefill.split(":")[0],
            "--prefiller-ports",
            prefill.split(":")[1],
            "--decoder-hosts",
            decode.split(":")[0],
            "--decoder-ports",
            decode.split(":")[1],
            "--store-dir",
            store_dir,
            *(extra_args or []),
        ]
        if redis_url:
            cmd += ["--redis-url", redis_url]
        super().__init__("proxy", cmd, log_path, timeout_s=30, env=env)


class VllmRouterProcess(FrontDoor):
    """vLLM's Rust router (PyPI ``vllm-router``) in P/D mode, where ``kvobs proxy`` would
    be: one P and one D, NIXL, under ``policy`` (None: the router's own default, which
    its ``--help`` names: cache_aware), which needs no engine endpoint beyond the API
    servers.

    Each request goes to P (``max_tokens`` 1, non-streamed, ``kv_transfer_params``
    ``do_remote_decode``) and then to D with P's returned params; it keeps no state
    between turns, so P never gets D's params (kvobs/testbed/NOTES.md, "vllm-router").
    No retries and no circuit breaker: one turn is one P and one D request, and a failed
    turn cannot make the router refuse the next ones."""

    def __init__(
        self,
        log_path: Path,
        *,
        prefill_url: str,
        decode_url: str,
        port: int | None = None,
        policy: str | None = ROUND_ROBIN,
    ):
        if importlib.util.find_spec("vllm_router_rs") is None:
            raise ServiceError("vllm-router not installed (scripts/setup.sh installs it)")
        fresh, self.metrics_port = free_ports(2)
        self.port = port or fresh
        cmd = [
            sys.executable,
            "-m",
            "vllm_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--vllm-pd-disaggregation",
            "--kv-connector",
            "nixl",
            "--prefill",
            prefill_url,
            "--decode",
            decode_url,
            *(("--policy", policy) if policy else ()),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.metrics_port),
            # The engines are up already: check them at once, not every 30 s.
            "--worker-startup-check-interval",
            "1",
            "--disable-retries",
            "--disable-circuit-breaker",
        ]
        super().__init__("vllm-router", cmd, log_path, timeout_s=60)

    @property
    def metrics_url(self) -> str:  # its own port (--prometheus-port)
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


class CollectProcess(Process):
    """``kvobs collect``: receives OTLP traces into ``store_dir`` (and classifies them)."""

    def __init__(
        self,
        log_path: Path,
        store_dir: str,
        port: int | None = None,
        extra_args: list[str] | None = None,
        nice: int = 0,
    ):
        self.port = port or free_ports(1)[0]
        super().__init__(
            "collect",
            [
                sys.executable,
                "-m",
                "kvobs",
                "collect",
                "--store-dir",
                store_dir,
                "--port",
                str(self.port),
                *(extra_args or ()),
            ],
            log_path,
        )
        # nice: off the CPU of the proxy and the client, whose timing the scenarios check.
        # Its own session is its own autogroup, inside which a `nice -n` prefix weighs
        # nothing against other sessions: the session's niceness is set (as the engines').
        if nice:
            yield_cpu(self.pid, nice)
        self.wait_until(lambda: _http_ok(f"http://127.0.0.1:{self.port}/health"), 30, "healthy")

    @property
    def traces_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def settled(self, timeout_s: float = 60.0, turns: int = 0) -> bool:
        """Waits until the classifier holds no open turn (every turn final) and has
        counted at least ``turns`` final turns."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=5) as answer:
                    text = answer.read().decode()
            except OSError:
                text = ""
            open_turns = [
                line
                for line in text.splitlines()
                if line.startswith(sc.M_CLASSIFIER_OPEN_TURNS.name + " ")
            ]
            counted = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(sc.M_TURNS.name + "{")
            )
            if open_turns and float(open_turns[0].split()[1]) == 0 and counted >= turns:
                return True
            time.sleep(0.5)
        return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
