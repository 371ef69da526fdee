"""One HTTP GET under a total time limit: what every trace-API read goes through.

A socket timeout bounds each read, not the answer: a server that trickles its answer (a
byte every few seconds) held the reader for as long as it liked. Here a timer shuts the
connection's socket down when the total runs out, wherever the read is (status line,
headers, body, a redirect's second connection), and the read fails with
``TimeoutError``. Connecting is bounded by what is left of the total; a TLS handshake's
reads each by what was left when it began.

Proxies from the environment (``http_proxy``, ``no_proxy``) apply as in ``urllib``.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import NamedTuple

TOTAL_TIMEOUT_S = 60.0
ERROR_TEXT_BYTES = 300  # of an error answer's body, for the message


class Answer(NamedTuple):
    status: int
    reason: str
    body: bytes  # an error answer's: its first ERROR_TEXT_BYTES


class _Deadline:
    """Shuts every socket it watches down once ``seconds`` have passed."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return max(self.end - time.monotonic(), 0.001)

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    """Wake a read blocked on ``sock`` (the plain socket's call: a TLS socket's own
    would drop its TLS state under the reading thread)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # closed meanwhile
        pass


def _watched(base: type[http.client.HTTPConnection], deadline: _Deadline):
    class Watched(base):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            self.timeout = deadline.left()
            super().connect()
            deadline.watch(self.sock)

    return Watched


class _HttpHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_watched(http.client.HTTPConnection, self.deadline), req)


class _HttpsHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(
            _watched(http.client.HTTPSConnection, self.deadline), req, context=self._context
        )


def get(
    url: str,
    headers: dict[str, str] | None = None,
    secret_headers: dict[str, str] | None = None,
    total_s: float = TOTAL_TIMEOUT_S,
) -> Answer:
    """GET ``url``, the whole answer within ``total_s`` seconds. An error status is an
    ``Answer`` too. ``secret_headers`` (credentials) are not sent on to a redirect's
    target. Raises ``TimeoutError`` when the total runs out, ``OSError`` (``URLError``)
    when the server cannot be reached."""
    deadline = _Deadline(total_s)
    request = urllib.request.Request(url, headers=headers or {})
    for name, value in (secret_headers or {}).items():
        request.add_unredirected_header(name, value)
    opener = urllib.request.build_opener(_HttpHandler(deadline), _HttpsHandler(deadline))
    try:
        try:
            with opener.open(request, timeout=deadline.left()) as response:
                answer = Answer(response.status, response.reason, response.read())
        except urllib.error.HTTPError as error:
            answer = Answer(
                error.code, str(error.reason), error.read(ERROR_TEXT_BYTES) if error.fp else b""
            )
    except (OSError, http.client.HTTPException) as error:
        if deadline.expired:
            raise TimeoutError(f"no whole answer within {total_s:g} s") from error
        if isinstance(error, http.client.HTTPException):
            raise OSError(f"broken answer ({type(error).__name__}: {error})") from error
        raise
    finally:
        deadline.cancel()
    if deadline.expired:  # the body cut short by the timer, read as if whole
        raise TimeoutError(f"no whole answer within {total_s:g} s")
    return answer
