"""The proxy's logs, in logfmt: ``key=value`` pairs, one line per event.

Every proxy log call passes its facts as fields (``log(logger, level, event, **fields)``);
``LogfmtFormatter`` writes them after ``time``, ``level``, ``logger`` and ``msg``, and
writes other libraries' records (aiohttp, redis) the same way. Values never hold prompt or
completion text, and the start-up line never holds a secret (``effective_config``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from typing import Any
from urllib.parse import urlsplit, urlunsplit

FIELDS = "kvobs_fields"  # the LogRecord attribute that carries a call's fields
_SECRET = ("engine_api_key",)


def log(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={FIELDS: fields})


def _value(value: Any) -> str:
    text = (
        value
        if isinstance(value, str)
        else ("true" if value else "false")
        if isinstance(value, bool)
        else str(value)
    )
    if text and not any(c in text for c in ' ="\\\n\t') and text.isprintable():
        return text
    escaped = (
        text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    )
    return f'"{escaped}"'


def logfmt(fields: dict[str, Any]) -> str:
    """One logfmt line; None values are left out.

    >>> logfmt({"msg": "engine failed", "role": "decode", "status": 502, "x": None})
    'msg="engine failed" role=decode status=502'
    """
    return " ".join(f"{key}={_value(value)}" for key, value in fields.items() if value is not None)


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        created = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        fields = {
            "time": f"{created}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **getattr(record, FIELDS, {}),
        }
        if record.exc_info and record.exc_info[0] is not None:
            kind, error, _ = record.exc_info
            fields["error"] = f"{kind.__name__}: {error}"
            fields["stack"] = "".join(traceback.format_exception(*record.exc_info))
        return logfmt(fields)


def configure(level: str) -> None:
    """Root logging in logfmt (``kvobs proxy``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(LogfmtFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])


def _redacted_url(url: str | None) -> str | None:
    """A URL without its password.

    >>> _redacted_url("redis://user:secret@10.0.0.1:6379/0")
    'redis://user:***@10.0.0.1:6379/0'
    """
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def effective_config(config: Any) -> dict[str, Any]:
    """A ProxyConfig as start-up line fields: every setting, secrets left out (the
    engines' API key) or masked (a password in the Redis URL)."""
    fields: dict[str, Any] = {}
    for item in dataclasses.fields(config):
        if item.name in _SECRET:
            continue
        value = getattr(config, item.name)
        if item.name in ("prefill", "decode"):
            value = ",".join(f"{e.host}:{e.port}" for e in value)
        elif item.name == "redis_url":
            value = _redacted_url(value)
        fields[item.name] = value
    fields["engine_api_key_set"] = bool(getattr(config, "engine_api_key", None))
    return fields
