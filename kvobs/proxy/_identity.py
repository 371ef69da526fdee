"""Who is asking: tenant (from the API key or a configured header) and conversation id.

The tenant never leaves the proxy in clear: spans, params and store keys carry a short
digest of it, so two tenants sending the same conversation id never share an entry.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

ANONYMOUS = "anonymous"


class InputError(ValueError):
    """A client error the proxy answers with a 4xx; ``reason`` is a bounded label value."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Identity:
    tenant: str  # digest, never the key
    conversation_id: str | None

    @property
    def store_key(self) -> str | None:
        if self.conversation_id is None:
            return None
        conv = hashlib.sha256(self.conversation_id.encode()).hexdigest()[:32]
        return f"{self.tenant}:{conv}"


def tenant_digest(secret: str) -> str:
    """Short, stable digest of a tenant credential.

    >>> tenant_digest("sk-a") == tenant_digest("sk-a") != tenant_digest("sk-b")
    True
    >>> len(tenant_digest("sk-a"))
    16
    """
    return hashlib.sha256(b"kvobs-tenant\0" + secret.encode()).hexdigest()[:16]


def tenant_of(headers: Mapping[str, str], tenant_header: str | None, max_len: int = 4096) -> str:
    """The tenant digest, or ``ANONYMOUS`` for no credential: no header, an empty one, or
    a bare ``Bearer`` scheme (HTTP strips the trailing space of ``Bearer ``).

    >>> [tenant_of({"Authorization": v}, None) for v in ("", "Bearer", "bearer  ", " ")]
    ['anonymous', 'anonymous', 'anonymous', 'anonymous']
    >>> tenant_of({"Authorization": "Bearer sk-a"}, None) == tenant_digest("sk-a")
    True
    """
    if tenant_header:
        raw = headers.get(tenant_header)
    else:
        raw = (headers.get("Authorization") or "").strip()
        scheme, _, rest = raw.partition(" ")
        if scheme.lower() == "bearer":
            raw = rest
    raw = (raw or "").strip()
    if len(raw) > max_len:
        raise InputError(400, "tenant-too-long", "tenant credential too long")
    return tenant_digest(raw) if raw else ANONYMOUS


def conversation_of(
    body: dict[str, Any], headers: Mapping[str, str], header: str, max_len: int
) -> str | None:
    """Pop ``conversation_id`` from the body (vLLM would only ignore it) or read the header.

    >>> conversation_of({"conversation_id": "c1", "x": 1}, {}, "X-Session-ID", 8)
    'c1'
    >>> conversation_of({}, {"X-Session-ID": "s9"}, "X-Session-ID", 8)
    's9'
    >>> conversation_of({}, {}, "X-Session-ID", 8) is None
    True
    """
    value = body.pop("conversation_id", None)
    if value is None:
        value = headers.get(header)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InputError(400, "bad-conversation-id", "conversation_id must be a string")
    if len(value) > max_len:
        raise InputError(
            400, "conversation-id-too-long", f"conversation id longer than {max_len} characters"
        )
    return value
