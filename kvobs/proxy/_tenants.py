"""The bound on new tenants per window (``--max-new-tenants``), against invented keys.

Each tenant is a trust domain with its own entry quota, so a client that invents API keys
gets a fresh quota with each one and, with enough of them, pushes other tenants' entries
out through the global cap. This process admits at most ``limit`` tenants it has not seen
before per ``window_s``; a new tenant past that is served without reuse (no lookup, no
store) until a later window admits it. Admitted tenants are remembered (the most recent
``memory`` of them). The decision itself is ``decide.admit_tenant``.
"""

from __future__ import annotations

from collections import OrderedDict

from kvobs.proxy import decide


class NewTenants:
    def __init__(self, limit: int, window_s: float, memory: int):
        self.limit, self.window_s, self.memory = limit, window_s, memory
        self._known: OrderedDict[str, None] = OrderedDict()
        self._window_start = 0.0
        self._admitted = 0

    def admit(self, tenant: str, now: float) -> tuple[bool, bool]:
        """(may use the store, is newly admitted)."""
        if self.limit <= 0:
            return True, False
        known = tenant in self._known
        if known:
            self._known.move_to_end(tenant)
            return True, False
        if now - self._window_start >= self.window_s:
            self._window_start, self._admitted = now, 0
        if not decide.admit_tenant(known, self._admitted, self.limit):
            return False, False
        self._admitted += 1
        self._known[tenant] = None
        if len(self._known) > self.memory:
            self._known.popitem(last=False)
        return True, True
