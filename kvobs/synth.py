"""Synthetic span sets at fleet scale: for benchmarks, fleet reports and tests only.

Nothing here comes from a real engine. Real recordings come from the CPU testbed
(``kvobs.testbed``) or a deployment; this module *simulates* what the proxy, P and D would
emit for many multi-turn conversations, with the same span names and attributes as the
real emitters (``tests/spanfactory.py`` shows them one turn at a time), and writes them
straight into the embedded store's parquet layout. Every conversation id starts with
``SYNTHETIC_PREFIX`` and every span carries ``service.name`` of the real role, so a
synthetic store is never mistaken for a recording.

The simulation is vectorised (numpy, Arrow): one million conversations take a few
minutes on two cores, generated bucket group by bucket group so memory stays bounded and
each store bucket gets one file.

Model, per conversation: ``K`` turns (geometric); a system prompt ``S``; each turn adds
the last reply ``R`` and new input ``T`` (``N_k = N_{k-1} + R_{k-1} + T_k``); gaps between
turns are a lognormal mixture with mass on both sides of D's TTL. Per later turn,
one scenario (``Scenario``): conversation id missing, proxy entry missing, history
rewritten (prefix mismatch), or the normal path, where the proxy's entry lifetime, D's
TTL, P's local prefix cache and ``kv_recompute_threshold`` decide stale / declined
(expired), local hit, below threshold or a read, which may fail or be slow.
"""

from __future__ import annotations

import enum
import os
import zlib
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvobs import semconv as sc
from kvobs.settings import DECODE_TTL, RECOMPUTE_THRESHOLD, UPSTREAM_ENTRY_LIFETIME, read_declined

__all__ = [
    "SyntheticConfig",
    "Scenario",
    "SYNTHETIC_PREFIX",
    "simulate_turns",
    "spans_table",
    "write_store",
    "synthetic_frame",
]

SYNTHETIC_PREFIX = "synthetic-"
SECOND = 1_000_000_000
BLOCK = 16


class Scenario(str, enum.Enum):
    """What the simulation made happen to a turn (the ground truth tests compare with)."""

    FIRST = "first"
    NO_ID = "no-id"
    PROXY_MISS = "proxy-miss"
    PROXY_MISMATCH = "proxy-prefix-mismatch"
    P_MISMATCH = "prefill-prefix-mismatch"
    STALE = "stale"
    DECLINED = "declined"
    LOCAL_HIT = "local-hit"
    BELOW_THRESHOLD = "below-threshold"
    FAILED = "failed"
    SLOW = "slow"
    HIT = "hit"
    RELEASED = "released"  # gap outlived D's TTL; P had no read to decline
    DROPPED = "dropped-decision-span"


# The verdict each scenario must end up with (kvobs's rules, not the simulation, decide).
EXPECTED_VERDICT = {
    Scenario.FIRST: sc.Verdict.FIRST_TURN,
    Scenario.NO_ID: sc.Verdict.MISSING_METADATA,
    Scenario.PROXY_MISS: sc.Verdict.MISSING_METADATA,
    Scenario.PROXY_MISMATCH: sc.Verdict.PREFIX_MISMATCH,
    Scenario.P_MISMATCH: sc.Verdict.PREFIX_MISMATCH,
    Scenario.STALE: sc.Verdict.EXPIRED,
    Scenario.DECLINED: sc.Verdict.EXPIRED,
    Scenario.RELEASED: sc.Verdict.EXPIRED,
    Scenario.LOCAL_HIT: sc.Verdict.LOCAL_HIT,
    Scenario.BELOW_THRESHOLD: sc.Verdict.BELOW_THRESHOLD,
    Scenario.FAILED: sc.Verdict.TRANSFER_FAILED,
    Scenario.SLOW: sc.Verdict.SLOW_TRANSFER,
    Scenario.HIT: sc.Verdict.REMOTE_HIT,
    Scenario.DROPPED: sc.Verdict.INSUFFICIENT_EVIDENCE,
}
_SCENARIOS = list(Scenario)
_CODE = {s: i for i, s in enumerate(_SCENARIOS)}


@dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of the simulation; defaults give a plausible agent fleet."""

    conversations: int = 1000
    seed: int = 0
    start_s: float = 1_700_000_000.0
    window_s: float = 86_400.0  # conversation starts spread over this window
    mean_turns: float = 5.0
    max_turns: int = 64
    # Gap mixture: active users/agents vs. ones that come back after a pause.
    gap_active_median_s: float = 30.0
    gap_active_sigma: float = 1.3
    gap_pause_median_s: float = 600.0
    gap_pause_sigma: float = 0.7
    gap_pause_share: float = 0.3
    system_median: float = 1500.0
    reply_median: float = 150.0
    input_median: float = 300.0
    ttl_s: float = DECODE_TTL.default  # decoder_kv_blocks_ttl
    proxy_lifetime_s: float = UPSTREAM_ENTRY_LIFETIME.default  # capped proxies' (fixed)
    uncapped_proxy_share: float = 0.3  # conversations behind a proxy with no lifetime cap
    threshold: int = RECOMPUTE_THRESHOLD.default
    bytes_per_token: int = 131_072  # KV bytes per token (e.g. an 8B model in bf16)
    read_gbps: float = 10.0  # D->P read throughput, GB/s
    read_overhead_s: float = 0.002  # fixed cost per read (handshake, descriptors)
    prefill_tokens_per_s: float = 8000.0
    decode_tokens_per_s: float = 60.0
    # Per later turn: probabilities of the injected faults.
    p_no_id: float = 0.02
    p_proxy_miss: float = 0.03
    p_prefix_mismatch: float = 0.03
    p_failed: float = 0.01
    p_slow: float = 0.03
    p_local_full: float = 0.03  # P's cache already covers D's tokens (local hit)
    p_prev_prompt_cached: float = 0.5  # P still holds last turn's prompt locally
    p_system_cached: float = 0.6
    p_dropped: float = 0.0  # P's decision span lost (insufficient evidence)
    tenants: int = 3  # conversations are spread over this many tenant digests


def tenant_digests(config: SyntheticConfig) -> list[str]:
    """Digest-shaped (16 hex) and marked synthetic (``5e`` like the trace ids)."""
    return [f"5e{zlib.crc32(f'{config.seed}-{i}'.encode()):014x}" for i in range(config.tenants)]


# --------------------------------------------------------------------------- turns


def conversation_ids(config: SyntheticConfig) -> np.ndarray:
    width = max(8, len(str(config.conversations)))
    return np.array(
        [f"{SYNTHETIC_PREFIX}{config.seed}-{i:0{width}d}" for i in range(config.conversations)],
        dtype=object,
    )


def _grouped_cumsum(values: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    total = np.cumsum(values)
    before = np.repeat(total[starts] - values[starts], sizes)
    return total - before


def _lognormal_int(rng, median, sigma, size, low=1):
    return np.maximum(low, rng.lognormal(np.log(median), sigma, size)).astype(np.int64)


def simulate_turns(
    config: SyntheticConfig, conversations: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """One entry per turn (flat arrays) for the given conversation numbers."""
    if conversations is None:
        conversations = np.arange(config.conversations)
    conversations = np.asarray(conversations, dtype=np.int64)
    # Seeded by the config and the chunk: the same config and chunking give the same set.
    rng = np.random.default_rng(
        [config.seed, int(conversations.sum()) % (2**32), len(conversations)]
    )
    n_conv = len(conversations)
    k = np.minimum(rng.geometric(1.0 / config.mean_turns, n_conv), config.max_turns)
    starts = np.concatenate([[0], np.cumsum(k)[:-1]])
    n = int(k.sum())
    conv = np.repeat(np.arange(n_conv), k)
    turn = np.arange(n) - np.repeat(starts, k) + 1
    first = turn == 1
    later = ~first

    system = _lognormal_int(rng, config.system_median, 0.6, n_conv, 64)
    reply = _lognormal_int(rng, config.reply_median, 1.0, n)
    new_input = _lognormal_int(rng, config.input_median, 1.2, n)
    prev_reply = np.where(first, 0, np.roll(reply, 1))
    increment = np.where(first, system[conv] + new_input, prev_reply + new_input)
    prompt = _grouped_cumsum(increment, starts, k)
    prev_prompt = np.where(first, 0, np.roll(prompt, 1))
    remote = np.where(first, 0, prev_prompt + prev_reply)  # C: D's H+R from last turn

    pause = rng.random(n) < config.gap_pause_share
    gap = np.where(
        pause,
        rng.lognormal(np.log(config.gap_pause_median_s), config.gap_pause_sigma, n),
        rng.lognormal(np.log(config.gap_active_median_s), config.gap_active_sigma, n),
    )
    gap = np.where(first, 0.0, gap)
    capped = (rng.random(n_conv) >= config.uncapped_proxy_share)[conv]

    # Local prefix hit L (block aligned).
    floor16 = lambda x: (x // BLOCK) * BLOCK  # noqa: E731
    prev_cached = rng.random(n) < config.p_prev_prompt_cached
    sys_cached = rng.random(n) < config.p_system_cached
    local = np.where(
        prev_cached & later, floor16(prev_prompt), np.where(sys_cached, floor16(system[conv]), 0)
    )
    local_full = later & (rng.random(n) < config.p_local_full)
    local = np.where(local_full, np.minimum(-(-remote // BLOCK) * BLOCK, prompt), local)
    local = np.minimum(local, prompt - 1)
    local = np.maximum(local, 0)

    # Scenario draw for later turns.
    u = rng.random(n)
    edges = np.cumsum([config.p_no_id, config.p_proxy_miss, config.p_prefix_mismatch])
    scenario = np.full(n, _CODE[Scenario.HIT], dtype=np.int8)
    scenario[first] = _CODE[Scenario.FIRST]
    scenario[later & (u < edges[0])] = _CODE[Scenario.NO_ID]
    scenario[later & (u >= edges[0]) & (u < edges[1])] = _CODE[Scenario.PROXY_MISS]
    mismatch = later & (u >= edges[1]) & (u < edges[2])
    by_proxy = rng.random(n) < 0.5
    scenario[mismatch & by_proxy] = _CODE[Scenario.PROXY_MISMATCH]
    scenario[mismatch & ~by_proxy] = _CODE[Scenario.P_MISMATCH]
    normal = scenario == _CODE[Scenario.HIT]
    stale = normal & capped & (gap > config.proxy_lifetime_s)
    scenario[stale] = _CODE[Scenario.STALE]
    normal &= ~stale
    candidate = np.where(later, np.maximum(0, np.minimum(remote, prompt) - local), 0)
    local_hit = normal & (candidate == 0) & (local > 0)
    scenario[local_hit] = _CODE[Scenario.LOCAL_HIT]
    below = normal & (candidate > 0) & (candidate < config.threshold)
    scenario[below] = _CODE[Scenario.BELOW_THRESHOLD]
    pull = normal & ~local_hit & ~below & (candidate >= config.threshold)
    declined = pull & read_declined(gap, config.ttl_s)
    scenario[declined] = _CODE[Scenario.DECLINED]
    reading = pull & ~declined
    v = rng.random(n)
    failed = reading & (v < config.p_failed)
    slow = reading & (v >= config.p_failed) & (v < config.p_failed + config.p_slow)
    scenario[failed] = _CODE[Scenario.FAILED]
    scenario[slow] = _CODE[Scenario.SLOW]
    # D released the blocks before the turn began: expired, whatever P then decided.
    released = (local_hit | below) & (gap > config.ttl_s + 0.001)
    scenario[released] = _CODE[Scenario.RELEASED]
    # A successful read whose decision span was lost: kvobs must say which span is missing.
    dropped = (scenario == _CODE[Scenario.HIT]) & (rng.random(n) < config.p_dropped)
    scenario[dropped] = _CODE[Scenario.DROPPED]

    read_bytes = candidate * config.bytes_per_token
    read_s = (config.read_overhead_s + read_bytes / (config.read_gbps * 1e9)) * rng.lognormal(
        0.0, 0.15, n
    )
    recompute_rate = config.prefill_tokens_per_s * rng.lognormal(0.0, 0.1, n)
    read_s = np.where(
        slow, (candidate / config.prefill_tokens_per_s) * rng.uniform(2, 6, n) + 0.05, read_s
    )
    return {
        "conv": conversations[conv],
        "turn": turn,
        "first": first,
        "scenario": scenario,
        "prompt": prompt,
        "local": local,
        "remote": remote,
        "candidate": candidate,
        "reply": reply,
        "gap": gap,
        "capped": capped,
        "read_bytes": read_bytes,
        "read_s": read_s,
        "recompute_rate": recompute_rate,
        "group_sizes": k,
        "group_starts": starts,
    }


def scenario_names(codes: np.ndarray) -> np.ndarray:
    return np.array([s.value for s in _SCENARIOS], dtype=object)[codes]


# --------------------------------------------------------------------------- spans


_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _hex(values: np.ndarray, digits: int) -> pa.Array:
    """uint64 values as fixed-width lowercase hex strings (vectorised)."""
    if digits > 16:
        return _prefixed("0" * (digits - 16), _hex(values, 16))
    values = values.astype(np.uint64)
    shifts = np.arange(digits - 1, -1, -1, dtype=np.uint64) * np.uint64(4)
    nibbles = (values[:, None] >> shifts[None, :]) & np.uint64(15)
    chars = _HEX[nibbles.astype(np.intp)]
    raw = np.ascontiguousarray(chars).view(f"S{digits}").ravel()
    return pc.cast(pa.array(raw, type=pa.binary(digits)), pa.large_string())


def _prefixed(prefix: str, strings: pa.Array) -> pa.Array:
    return pc.binary_join_element_wise(
        pa.scalar(prefix, pa.large_string()), strings, pa.scalar("", pa.large_string())
    )


class _Spans:
    """Collects column arrays per span kind and stitches them into one Arrow table."""

    def __init__(self, schema: pa.Schema, turns: dict, ids: pa.Array, config):
        self.schema, self.turns, self.ids, self.config = schema, turns, ids, config
        self.tables: list[pa.Table] = []
        conv, turn = turns["conv"].astype(np.uint64), turns["turn"].astype(np.uint64)
        self.trace_key = (conv << np.uint64(12)) | turn
        self.trace_hex = _prefixed("5e", _hex(self.trace_key, 30))  # 5e..: synthetic trace ids
        digests = tenant_digests(config)
        self.tenant = (
            pa.DictionaryArray.from_arrays(
                pa.array(turns["conv"] % len(digests), pa.int32()), pa.array(digests)
            ).cast(pa.large_string())
            if digests
            else pa.nulls(len(turns["conv"]), pa.large_string())
        )

    def add(
        self,
        span: sc.SpanName,
        mask: np.ndarray,
        start_ns,
        end_ns,
        attrs: dict,
        kind: int,
        error=None,
        parent_root: bool = True,
    ):
        rows = np.flatnonzero(mask)
        if len(rows) == 0:
            return
        take = pa.array(rows)
        m = len(rows)

        def sub(value):
            if isinstance(value, np.ndarray):
                return value[rows]
            if isinstance(value, (pa.Array, pa.ChunkedArray)):
                return value.take(take)
            return value

        span_key = (self.trace_key[rows] << np.uint64(4)) | np.uint64(kind)
        columns = {
            "trace_id": self.trace_hex.take(take),
            "span_id": _hex(span_key, 16),
            "parent_span_id": (
                _hex(self.trace_key[rows] << np.uint64(4), 16)
                if span is not sc.SPAN_PROXY_TURN
                else None
            ),
            "name": pa.array(np.full(m, span.name, dtype=object), pa.large_string()),
            "service": pa.array(np.full(m, span.service.value, dtype=object), pa.large_string()),
            "start_ns": pa.array(np.broadcast_to(sub(start_ns), m).astype(np.int64)),
            "end_ns": pa.array(np.broadcast_to(sub(end_ns), m).astype(np.int64)),
            "error": (
                pa.array(np.broadcast_to(sub(error), m).astype(bool))
                if error is not None
                else pa.array(np.zeros(m, dtype=bool))
            ),
            sc.CONVERSATION_ID.key: self.ids.take(pa.array(self.turns["conv_local"][rows])),
            sc.TURN_INDEX.key: pa.array(self.turns["turn"][rows].astype(np.int64)),
            sc.TENANT_DIGEST.key: self.tenant.take(take),
            sc.ROLE.key: pa.array(np.full(m, _ROLE[span.service], dtype=object), pa.large_string()),
        }
        for key, value in attrs.items():
            value = sub(value)
            if isinstance(value, np.ndarray) and value.dtype == object:
                columns[key] = pa.array(value, pa.large_string())
            elif isinstance(value, (pa.Array, pa.ChunkedArray)):
                columns[key] = value
            elif isinstance(value, str):
                columns[key] = pa.array(np.full(m, value, dtype=object), pa.large_string())
            else:
                columns[key] = pa.array(np.broadcast_to(value, m))
        arrays = []
        for column in self.schema:
            value = columns.get(column.name)
            arrays.append(pa.nulls(m, column.type) if value is None else value.cast(column.type))
        self.tables.append(pa.Table.from_arrays(arrays, schema=self.schema))

    def table(self) -> pa.Table:
        return pa.concat_tables(self.tables)


_ROLE = {sc.Service.PROXY: "proxy", sc.Service.PREFILL: "prefill", sc.Service.DECODE: "decode"}


def spans_table(
    config: SyntheticConfig, conversations: np.ndarray, schema: pa.Schema | None = None
) -> tuple[pa.Table, dict]:
    """Span table (store schema) for the given conversation numbers, and their turns."""
    from kvobs.sources.store import store_schema

    schema = schema or store_schema()
    conversations = np.asarray(conversations, dtype=np.int64)
    t = simulate_turns(config, conversations)
    ids = pa.array(conversation_ids(config)[conversations], pa.large_string())
    t["conv_local"] = np.repeat(np.arange(len(conversations)), t["group_sizes"])
    n = len(t["turn"])
    code = t["scenario"]
    is_ = lambda s: code == _CODE[s]  # noqa: E731
    first, later = t["first"], ~t["first"]
    rng = np.random.default_rng([config.seed, 7, int(conversations.sum()) % (2**32)])

    # --- timeline (ns). Each turn: start, P leg, decode, end; next start = end + gap.
    read_ok = is_(Scenario.HIT) | is_(Scenario.SLOW) | is_(Scenario.DROPPED)
    read_happens = read_ok | is_(Scenario.FAILED)
    declined, failed = is_(Scenario.DECLINED), is_(Scenario.FAILED)
    fallback = declined | failed
    read_s = np.where(read_happens, t["read_s"], np.where(declined, 0.0005, 0.0))
    read_s = np.where(failed, read_s * 0.5, read_s)
    reused = np.where(read_ok, t["candidate"], 0)
    computed = t["prompt"] - t["local"] - reused
    recompute_s = computed / t["recompute_rate"]
    queue_s = rng.exponential(0.01, n)
    prefill_s = 0.002 + read_s + recompute_s
    ttft = queue_s + prefill_s + 0.004
    decode_s = t["reply"] / config.decode_tokens_per_s
    duration_ns = ((ttft + decode_s) * SECOND).astype(np.int64)
    gap_ns = (t["gap"] * SECOND).astype(np.int64)
    conv_start = (config.start_s + rng.random(len(conversations)) * config.window_s) * SECOND
    step = duration_ns + np.where(first, 0, gap_ns)
    offset = _grouped_cumsum(step, t["group_starts"], t["group_sizes"])  # end of each turn
    end = np.repeat(conv_start.astype(np.int64), t["group_sizes"]) + offset
    start = end - duration_ns
    p0 = start + (queue_s * SECOND).astype(np.int64)
    read_start = p0 + 2_000_000
    read_end = read_start + (read_s * SECOND).astype(np.int64)
    end_s = end / SECOND

    # Timeline marks (unix s) as the proxy and the engines' request spans carry them.
    ms = 0.001
    mark = {"start": start / SECOND, "p0": p0 / SECOND}
    mark["p_sent"] = mark["start"] + 0.5 * ms
    mark["p_arrived"] = mark["p_sent"] + 0.5 * ms
    mark["p_scheduled"] = mark["p0"] + 1 * ms
    mark["p_allocated"] = mark["p0"] + 1.1 * ms
    mark["p_first_token"] = mark["p0"] + 2 * ms + read_s + recompute_s
    mark["p_answered"] = mark["p_first_token"] + 0.5 * ms
    mark["d_sent"] = mark["p_answered"] + 0.3 * ms
    mark["d_arrived"] = mark["d_sent"] + 0.5 * ms
    mark["d_scheduled"] = mark["d_arrived"] + 0.2 * ms
    mark["handoff_start"] = mark["d_scheduled"] + 0.2 * ms
    mark["d_kv_ready"] = mark["handoff_start"] + 0.8 * ms
    mark["d_first_token"] = mark["start"] + ttft
    mark["d_answered"] = end / SECOND - 0.3 * ms

    spans = _Spans(schema, t, ids, config)
    S = sc  # noqa: N806
    # Proxy turn span (root of the trace). Non-streamed: no TTFT at the proxy.
    spans.add(
        S.SPAN_PROXY_TURN,
        np.ones(n, bool),
        start,
        end,
        {
            S.STREAM.key: False,
            S.PREFILL_TIME.key: prefill_s,
            S.DECODE_TIME.key: decode_s,
            S.PREFILL_SENT_AT.key: mark["p_sent"],
            S.PREFILL_ANSWERED_AT.key: mark["p_answered"],
            S.DECODE_SENT_AT.key: mark["d_sent"],
            S.DECODE_ANSWERED_AT.key: mark["d_answered"],
        },
        kind=0,
    )
    # Proxy lookup (later turns).
    lookup = np.full(n, LookupOutcome_HIT, dtype=object)
    lookup[is_(Scenario.NO_ID)] = sc.LookupOutcome.NO_ID.value
    lookup[is_(Scenario.PROXY_MISS)] = sc.LookupOutcome.MISS.value
    lookup[is_(Scenario.PROXY_MISMATCH)] = sc.LookupOutcome.PREFIX_MISMATCH.value
    lookup[is_(Scenario.STALE)] = sc.LookupOutcome.STALE.value
    params_sent = lookup == LookupOutcome_HIT
    lifetime = np.where(t["capped"], config.proxy_lifetime_s, np.nan)
    has_entry = ~(is_(Scenario.NO_ID) | is_(Scenario.PROXY_MISS))
    spans.add(
        S.SPAN_PROXY_LOOKUP,
        later,
        start,
        start + 500_000,
        {
            S.LOOKUP_OUTCOME.key: lookup,
            S.PARAMS_SENT.key: params_sent,
            S.INTER_TURN_GAP.key: t["gap"],
            S.ENTRY_AGE.key: pa.array(t["gap"], mask=~has_entry),
            S.ENTRY_REMAINING_TTL.key: pa.array(
                lifetime - t["gap"], mask=~has_entry | ~t["capped"]
            ),
        },
        kind=1,
    )
    # P's pull decision.
    decision = np.full(n, sc.PullDecision.PULL.value, dtype=object)
    no_params = first | ~params_sent
    decision[no_params] = sc.PullDecision.NO_PARAMS.value
    decision[is_(Scenario.P_MISMATCH)] = sc.PullDecision.PREFIX_MISMATCH.value
    decision[is_(Scenario.LOCAL_HIT)] = sc.PullDecision.LOCAL_HIT.value
    decision[is_(Scenario.BELOW_THRESHOLD)] = sc.PullDecision.BELOW_THRESHOLD.value
    remote = np.where(no_params, 0, t["remote"])
    candidate = np.where(no_params, 0, t["candidate"])
    request = _prefixed("p-", spans.trace_hex)
    matched = (t["remote"] * rng.uniform(0.3, 0.95, n)).astype(np.int64)
    spans.add(
        S.SPAN_PULL_DECISION,
        ~is_(Scenario.DROPPED),
        p0 + 1_000_000,
        p0 + 1_100_000,
        {
            S.PROMPT_TOKENS.key: t["prompt"],
            S.LOCAL_HIT_TOKENS.key: t["local"],
            S.REMOTE_TOKENS.key: remote,
            S.CANDIDATE_TOKENS.key: candidate,
            S.THRESHOLD.key: config.threshold,
            S.PULL_DECISION.key: decision,
            S.REQUEST_ID.key: request,
            S.PREFIX_MATCHED_TOKENS.key: pa.array(matched, mask=~is_(Scenario.P_MISMATCH)),
        },
        kind=2,
    )
    # The read (done, declined or failed).
    outcome = np.full(n, sc.ReadOutcome.DONE.value, dtype=object)
    outcome[declined] = sc.ReadOutcome.DECLINED_EXPIRED.value
    outcome[failed] = sc.ReadOutcome.FAILED.value
    blocks = -(-t["candidate"] // BLOCK)
    spans.add(
        S.SPAN_READ,
        read_happens | declined,
        read_start,
        read_end,
        {
            S.READ_DIRECTION.key: "d_to_p",
            S.READ_OUTCOME.key: outcome,
            S.READ_BYTES.key: np.where(
                declined, 0, np.where(failed, t["read_bytes"] // 2, t["read_bytes"])
            ),
            S.READ_BLOCKS.key: np.where(declined, 0, blocks),
            S.READ_DURATION.key: read_s,
            S.READ_ERROR.key: pa.array(
                np.full(n, "nixl-transfer-error", dtype=object), mask=~failed
            ),
            S.REMAINING_TTL_AT_READ.key: config.ttl_s - t["gap"],
            S.READ_SETUP.key: 0.2 * ms,
            S.REMOTE_ENGINE_ID.key: "synthetic-decode-0",
        },
        kind=3,
        error=failed,
    )
    # Fallback: the proxy retries P without params; P decides again and recomputes.
    spans.add(
        S.SPAN_PROXY_FALLBACK,
        fallback,
        read_end,
        read_end + 200_000,
        {
            S.FALLBACK_REASON.key: np.where(
                declined, sc.FallbackReason.READ_DECLINED.value, sc.FallbackReason.READ_FAILED.value
            ).astype(object)
        },
        kind=4,
    )
    spans.add(
        S.SPAN_PULL_DECISION,
        fallback,
        read_end + 300_000,
        read_end + 400_000,
        {
            S.PROMPT_TOKENS.key: t["prompt"],
            S.LOCAL_HIT_TOKENS.key: t["local"],
            S.REMOTE_TOKENS.key: 0,
            S.CANDIDATE_TOKENS.key: 0,
            S.THRESHOLD.key: config.threshold,
            S.PULL_DECISION.key: sc.PullDecision.NO_PARAMS.value,
            S.REQUEST_ID.key: _prefixed("p-retry-", spans.trace_hex),
        },
        kind=5,
    )
    # P computes what it did not reuse.
    reason = np.full(n, sc.RecomputeReason.SUFFIX.value, dtype=object)
    reason[no_params] = sc.RecomputeReason.NO_PARAMS.value
    reason[is_(Scenario.P_MISMATCH)] = sc.RecomputeReason.PREFIX_MISMATCH.value
    reason[is_(Scenario.BELOW_THRESHOLD)] = sc.RecomputeReason.BELOW_THRESHOLD.value
    reason[fallback] = sc.RecomputeReason.FALLBACK.value
    spans.add(
        S.SPAN_RECOMPUTE,
        computed > 0,
        read_end + 500_000,
        read_end + 500_000 + (recompute_s * SECOND).astype(np.int64),
        {S.RECOMPUTED_TOKENS.key: computed, S.RECOMPUTE_REASON.key: reason},
        kind=6,
    )
    # P's and D's request spans (timeline marks) and D's pull of P's KV.
    read_kv = read_ok & ~is_(Scenario.DROPPED)
    spans.add(
        S.SPAN_PREFILL_REQUEST,
        ~fallback,
        (mark["p_arrived"] * SECOND).astype(np.int64),
        (mark["p_first_token"] * SECOND).astype(np.int64),
        {
            S.REQUEST_ARRIVED_AT.key: mark["p_arrived"],
            S.REQUEST_SCHEDULED_AT.key: mark["p_scheduled"],
            S.REQUEST_ALLOCATED_AT.key: mark["p_allocated"],
            S.REQUEST_KV_READY_AT.key: pa.array(read_end / SECOND + 0.2 * ms, mask=~read_kv),
            S.REQUEST_FIRST_TOKEN_AT.key: mark["p_first_token"],
            S.PROMPT_TOKENS.key: t["prompt"],
            S.OUTPUT_TOKENS.key: 1,
        },
        kind=10,
    )
    spans.add(
        S.SPAN_HANDOFF,
        np.ones(n, bool),
        (mark["handoff_start"] * SECOND).astype(np.int64),
        (mark["d_kv_ready"] * SECOND).astype(np.int64),
        {
            S.READ_DIRECTION.key: "p_to_d",
            S.READ_OUTCOME.key: "done",
            S.READ_BYTES.key: t["prompt"] * 512,
            S.READ_DURATION.key: 0.8 * ms,
            S.READ_SETUP.key: 0.2 * ms,
        },
        kind=11,
    )
    spans.add(
        S.SPAN_DECODE_REQUEST,
        np.ones(n, bool),
        (mark["d_arrived"] * SECOND).astype(np.int64),
        end - 300_000,
        {
            S.REQUEST_ARRIVED_AT.key: mark["d_arrived"],
            S.REQUEST_SCHEDULED_AT.key: mark["d_scheduled"],
            S.REQUEST_KV_READY_AT.key: mark["d_kv_ready"],
            S.REQUEST_FIRST_TOKEN_AT.key: mark["d_first_token"],
            S.PROMPT_TOKENS.key: t["prompt"],
            S.OUTPUT_TOKENS.key: t["reply"],
        },
        kind=12,
    )
    # D retains H+R and exports its params; the proxy stores them.
    export_tokens = t["prompt"] + t["reply"]
    export_blocks = export_tokens // BLOCK
    spans.add(
        S.SPAN_EXPORT,
        np.ones(n, bool),
        end - 1_000_000,
        end,
        {
            S.EXPORT_TOKENS.key: export_tokens,
            S.EXPORT_BLOCKS.key: export_blocks,
            S.EXPORT_EXPIRES_AT.key: end_s + config.ttl_s,
            S.TTL.key: config.ttl_s,
            S.REQUEST_ID.key: _prefixed("d-", spans.trace_hex),
        },
        kind=7,
    )
    spans.add(
        S.SPAN_PROXY_STORE,
        np.ones(n, bool),
        end,
        end + 300_000,
        {
            S.STORE_ACTION.key: "stored",
            S.PARAMS_SOURCE.key: sc.ParamsSource.BODY.value,
            S.STORE_EXPIRES_AT.key: pa.array(end_s + config.proxy_lifetime_s, mask=~t["capped"]),
        },
        kind=8,
    )
    # D releases: when the next turn read the blocks, or at expiry.
    next_reads = np.zeros(n, bool)
    next_reads[:-1] = read_ok[1:] & later[1:]
    next_read_end = np.zeros(n, np.int64)
    next_read_end[:-1] = read_end[1:]
    release_at = np.where(next_reads, next_read_end, end + int(config.ttl_s * SECOND))
    held = (release_at - end) / SECOND
    spans.add(
        S.SPAN_RELEASE,
        np.ones(n, bool),
        release_at,
        release_at + 100_000,
        {
            S.RELEASE_REASON.key: np.where(
                next_reads, sc.ReleaseReason.READ.value, sc.ReleaseReason.EXPIRED.value
            ).astype(object),
            S.RELEASE_READ_COUNT.key: next_reads.astype(np.int64),
            S.HELD_DURATION.key: held,
            S.EXPORT_BLOCKS.key: export_blocks,
        },
        kind=9,
    )
    return spans.table(), t


LookupOutcome_HIT = sc.LookupOutcome.HIT.value


def synthetic_frame(config: SyntheticConfig):
    """A small synthetic set as a pandas span table (tests, notebooks)."""
    from kvobs.sources._frame import ALL_DTYPES

    table, _ = spans_table(config, np.arange(config.conversations))
    import pandas as pd

    return table.to_pandas(types_mapper=pd.ArrowDtype).astype(ALL_DTYPES)


@dataclass
class WriteResult:
    conversations: int = 0
    turns: int = 0
    spans: int = 0
    scenarios: dict[str, int] = field(default_factory=dict)


def write_store(
    store_dir: str, config: SyntheticConfig, buckets_per_chunk: int = 4, progress=None
) -> WriteResult:
    """Simulate ``config.conversations`` and write them into ``store_dir`` (embedded store
    layout), a group of buckets at a time so that each bucket gets one file."""
    from kvobs.sources.store import BUCKETS, COMPACTED_DIR, store_schema, write_table

    os.makedirs(os.path.join(store_dir, COMPACTED_DIR), exist_ok=True)
    schema = store_schema()
    ids = conversation_ids(config)
    buckets = np.fromiter(
        (zlib.crc32(cid.encode()) % BUCKETS for cid in ids), dtype=np.int32, count=len(ids)
    )
    result = WriteResult()
    counts = np.zeros(len(_SCENARIOS), np.int64)
    for first_bucket in range(0, BUCKETS, buckets_per_chunk):
        chosen = np.flatnonzero(
            (buckets >= first_bucket) & (buckets < first_bucket + buckets_per_chunk)
        )
        if len(chosen) == 0:
            continue
        table, turns = spans_table(config, chosen, schema)
        result.spans += write_table(store_dir, table)
        result.conversations += len(chosen)
        result.turns += len(turns["turn"])
        counts += np.bincount(turns["scenario"], minlength=len(_SCENARIOS))
        if progress:
            progress(first_bucket + buckets_per_chunk, result)
    result.scenarios = {s.value: int(c) for s, c in zip(_SCENARIOS, counts)}
    return result


def small(conversations: int = 200, seed: int = 1, **overrides) -> SyntheticConfig:
    """A small config for tests, with every scenario common enough to appear."""
    base = SyntheticConfig(
        conversations=conversations,
        seed=seed,
        p_no_id=0.05,
        p_proxy_miss=0.05,
        p_prefix_mismatch=0.08,
        p_failed=0.05,
        p_slow=0.08,
        p_local_full=0.06,
        p_dropped=0.02,
    )
    return replace(base, **overrides)
