"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: fd 3 in, fd 4 out, NUL-terminated JSON; stdlib only).

``load(url)`` opens a page and returns what an operator's browser would have shown in
its console: console.error/warning calls, uncaught exceptions, and the browser's own
log entries (a resource that failed to load, a blocked request), plus a full-page
screenshot and the values of a few DOM expressions.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LEVELS = ("error", "warning", "assert")


@dataclass
class PageLoad:
    console: list[str] = field(default_factory=list)  # errors and warnings, as text
    screenshot: bytes = b""
    values: dict[str, object] = field(default_factory=dict)


class _Pipe:
    def __init__(self, to_browser: int, from_browser: int):
        self.write_fd, self.read_fd = to_browser, from_browser
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 60.0) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        reply = self.wait(lambda m: m.get("id") == self.next_id, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait(self, matches, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, message in enumerate(self.events):
                if matches(message):
                    return self.events.pop(i)
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                raise EOFError("chromium closed the pipe")
            self.buffer += chunk
            *messages, self.buffer = self.buffer.split(b"\0")
            self.events += [json.loads(m) for m in messages if m]


def _console_lines(events: list[dict]) -> list[str]:
    lines = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in LEVELS:
            text = " ".join(str(a.get("value", a.get("description", "")))
                            for a in params.get("args", []))
            lines.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            lines.append("exception: " + details.get("exception", {}).get(
                "description", details.get("text", "")))
        elif method == "Log.entryAdded" and params["entry"]["level"] in LEVELS:
            entry = params["entry"]
            lines.append(f"{entry['source']} {entry['level']}: {entry['text']} "
                         f"{entry.get('url', '')}".rstrip())
    return lines


def load(url: str, width: int = 1300, expressions: dict[str, str] | None = None,
         settle_s: float = 0.5) -> PageLoad:
    """Open ``url`` in a fresh headless Chromium profile, wait for its load event."""
    profile = tempfile.mkdtemp(prefix="kvobs-chromium-")
    to_read, to_browser = os.pipe()
    from_browser, to_write = os.pipe()

    def wire() -> None:  # in the child, before exec: the pipe ends become fds 3 and 4
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_read, to_write)]
        os.dup2(high[0], 3)
        os.dup2(high[1], 4)

    process = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--no-first-run", "--disable-extensions", "--remote-debugging-pipe",
         f"--user-data-dir={profile}", f"--window-size={width},900", "about:blank"],
        pass_fds=(3, 4), preexec_fn=wire, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_read)
    os.close(to_write)
    pipe = _Pipe(to_browser, from_browser)
    try:
        target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = pipe.send("Target.attachToTarget",
                            {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            pipe.send(f"{domain}.enable", session=session)
        pipe.send("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
            session=session)
        pipe.send("Page.navigate", {"url": url}, session=session)
        pipe.wait(lambda m: m.get("method") == "Page.loadEventFired", 120)
        time.sleep(settle_s)  # late console messages
        result = PageLoad()
        for name, expression in (expressions or {}).items():
            value = pipe.send("Runtime.evaluate", {"expression": expression,
                                                   "returnByValue": True}, session=session)
            result.values[name] = value["result"].get("value")
        height = pipe.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        shot = pipe.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height["height"],
                     "scale": 1}}, session=session)
        result.screenshot = base64.b64decode(shot["data"])
        pipe.send("Runtime.evaluate", {"expression": "1"}, session=session)  # drain
        result.console = _console_lines(pipe.events)
        try:
            pipe.send("Browser.close", timeout=10)
        except (EOFError, TimeoutError, RuntimeError):
            pass
        return result
    finally:
        os.close(to_browser)
        os.close(from_browser)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(profile, ignore_errors=True)
