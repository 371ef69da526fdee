"""Turn D's ``remote_blocks_expiry_time`` (D's monotonic clock) into proxy wall time.

D sets ``expiry = perf_counter_D(finish) + ttl`` when the request finishes. The proxy never
sees D's clock, but it knows each decode request was *sent* before D finished it and
*answered* after. So for every response from engine E:

    sent_wall - (expiry_D - ttl)  <=  offset_E  <=  answered_wall - (expiry_D - ttl)

where ``offset_E`` maps E's monotonic clock to wall time. The largest lower bound seen so
far for E (its shortest decode) is kept, and an entry's wall expiry is
``expiry_D + offset_lower``, clamped to ``[sent + ttl, answered + ttl]``. The estimate is
never later than D's real expiry (clocks consistent), and close to it after one short
request. A new D process gets a new engine id; a wall clock stepped backwards is caught by
the upper clamp.
"""

from __future__ import annotations

from collections import OrderedDict


class DecodeClock:
    def __init__(self, max_engines: int = 1024):
        self._offsets: OrderedDict[str, float] = OrderedDict()
        self._max = max_engines

    def expiry_wall(
        self, engine_id: str, expiry_d: float, ttl_s: float, sent_wall: float, answered_wall: float
    ) -> float:
        """Wall-clock instant at or before which D's blocks expire.

        >>> clock = DecodeClock()
        >>> clock.expiry_wall("d", 1480.0, 480.0, sent_wall=5000.0, answered_wall=5000.1)
        5480.0
        >>> # a long decode (sent 6900, answered 7100, finished at D time 3000) inherits the
        >>> # offset pinned by the quick one: 7480, not the pessimistic sent + ttl = 7380
        >>> clock.expiry_wall("d", 3480.0, 480.0, sent_wall=6900.0, answered_wall=7100.0)
        7480.0
        """
        finish_d = expiry_d - ttl_s
        lower = sent_wall - finish_d
        known = self._offsets.get(engine_id)
        offset = lower if known is None or lower > known else known
        self._offsets[engine_id] = offset
        self._offsets.move_to_end(engine_id)
        while len(self._offsets) > self._max:
            self._offsets.popitem(last=False)
        estimate = expiry_d + offset
        return round(min(max(estimate, sent_wall + ttl_s), answered_wall + ttl_s), 6)
