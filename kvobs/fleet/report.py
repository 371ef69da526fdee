"""The fleet report: verdict mix, reuse, bytes, TTFT, latency and D's retained memory, by
turn index and prompt length, the phases that cost the fleet most (``phase_ranking``) and
the retention cost on D and in the host tier (``kvobs.fleet.retention``), over every turn
of a source; turn 1 always apart."""

from __future__ import annotations

import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvobs.turns import columns as col
from kvobs import semconv as sc
from kvobs.turns.correlate import run_starts
from kvobs.fleet.retention import bytes_per_block, host_tokens_served, retention
from kvobs.fleet.since import since_cutoff_ns
from kvobs.turns.schema import CONVERSATION_KEYS
from kvobs.timeline import PHASES, add_timeline, phase_column
from kvobs.verdicts import classify_frame
from kvobs.semconv import NOT_FAULT_VALUES, ReadOutcome, ReleaseReason, Verdict


def label_turns(
    turns: pd.DataFrame, prefill_tokens_per_s: float | None = None, read_slo_s: float | None = None
) -> tuple[pd.DataFrame, float | None]:
    """Turn table plus its timeline (``kvobs.timeline``), ``verdict``, ``turn_bucket``
    and ``prompt_bucket`` columns."""
    turns, _, rate = add_timeline(turns, prefill_tokens_per_s)
    turns["verdict"] = classify_frame(turns, rate, read_slo_s).array
    add_buckets(turns)
    return turns, rate


def add_buckets(turns: pd.DataFrame) -> None:
    """The ``turn_bucket`` and ``prompt_bucket`` columns, in place."""
    turns["turn_bucket"] = _buckets(turns["turn"], sc.turn_bucket, sc.TURN_BUCKET_VALUES)
    prompt = np.nan_to_num(prompt_tokens(turns), nan=-1).astype(np.int64)
    turns["prompt_bucket"] = _buckets(
        pd.Series(prompt, index=turns.index),
        sc.prompt_bucket,
        sc.PROMPT_BUCKET_VALUES,
        known=prompt >= 0,
    )


def prompt_tokens(turns: pd.DataFrame) -> np.ndarray:
    """Per turn, its prompt length: P's pull decision's, else (an engine with only the
    offloading connector: no P) its host lookup's; NaN when neither says."""
    return np.where(
        col.present(turns, "prompt_tokens"),
        col.num(turns, "prompt_tokens"),
        col.num(turns, "host_lookup_prompt_tokens"),
    )


def _buckets(values: pd.Series, label, order, known: np.ndarray | bool = True) -> pd.Series:
    """Bucket labels as categorical codes (missing where not ``known``): one label call
    per distinct value, no per-turn strings."""
    inverse, uniques = pd.factorize(values.to_numpy(np.int64))  # hashed: no sort
    position = {name: i for i, name in enumerate(order)}
    codes = np.array([position.get(label(int(u)), -1) for u in uniques], np.int64)
    return pd.Series(
        pd.Categorical.from_codes(np.where(known, codes[inverse], -1), categories=list(order)),
        index=values.index,
    )


# Verdicts of the host path, counted apart in each scope's ``host_hit_ratio``.
HOST_VERDICTS = [
    v.value
    for v in (
        Verdict.HOST_HIT,
        Verdict.HOST_EVICTED,
        Verdict.HOST_SAVE_INCOMPLETE,
        Verdict.HOST_COPY_LACKS_RESPONSE,
    )
]


@dataclass
class Measured:
    """What each scope's metrics read, per turn, computed once for the whole table: a
    scope is then row positions into numpy arrays, never a copied frame."""

    verdict_codes: np.ndarray
    verdict_names: list[str]
    bytes_read: np.ndarray  # a finished read's bytes, else 0
    reused_tokens: np.ndarray  # a finished read's candidate tokens, else 0
    recomputed_tokens: np.ndarray
    host_load_bytes: np.ndarray
    host_reused_tokens: np.ndarray
    ttft_s: np.ndarray
    latency_s: np.ndarray

    @classmethod
    def of(cls, turns: pd.DataFrame) -> Measured:
        codes, names = pd.factorize(turns["verdict"])
        done = (turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False).to_numpy(bool)

        def counted(column: str, where: np.ndarray | bool = True) -> np.ndarray:
            values = turns[column].to_numpy(float, na_value=np.nan)
            return np.where(where & ~np.isnan(values), values, 0.0)

        return cls(
            codes,
            [str(name) for name in names],
            counted("read_bytes", done),
            counted("candidate_tokens", done),
            counted("recomputed_tokens"),
            np.nan_to_num(col.num(turns, "host_load_bytes")),
            host_tokens_served(turns),
            turns["ttft_s"].to_numpy(float, na_value=np.nan),
            turns["latency_s"].to_numpy(float, na_value=np.nan),
        )

    SUMS = (
        "bytes_read",
        "reused_tokens",
        "recomputed_tokens",
        "host_bytes_loaded",
        "host_reused_tokens",
    )

    def sums(self, rows: np.ndarray) -> dict[str, int]:
        """The summed metrics of the turns at ``rows`` (integers: exact in any order)."""
        return {
            "bytes_read": int(self.bytes_read.take(rows).sum()),
            "reused_tokens": int(self.reused_tokens.take(rows).sum()),
            "recomputed_tokens": int(self.recomputed_tokens.take(rows).sum()),
            "host_bytes_loaded": int(self.host_load_bytes.take(rows).sum()),
            "host_reused_tokens": int(self.host_reused_tokens.take(rows).sum()),
        }


def _metrics(measured: Measured, rows: np.ndarray) -> dict[str, Any]:
    """One scope's metrics over the turns at positions ``rows``."""
    codes = measured.verdict_codes.take(rows)
    tally = np.bincount(codes[codes >= 0], minlength=len(measured.verdict_names))
    ttft, latency = measured.ttft_s.take(rows), measured.latency_s.take(rows)
    return scope_metrics(
        len(rows),
        {name: int(k) for name, k in zip(measured.verdict_names, tally)},
        measured.sums(rows),
        _quantiles(ttft),
        _quantiles(latency),
        int(np.isnan(ttft).sum()),
    )


def scope_metrics(
    n: int,
    counts: dict[str, int],
    sums: dict[str, int],
    ttft: tuple[float | None, float | None],
    latency: tuple[float | None, float | None],
    ttft_unmeasured: int,
) -> dict[str, Any]:
    """A scope's metrics from its turn count, verdict counts, ``Measured.sums`` and the
    p50/p95 of TTFT and latency: whether exact (the span path) or sketched (turn rows)."""
    return {
        "turns": n,
        "verdicts": {v: counts[v] for v in sc.VERDICT_VALUES if counts.get(v, 0)},
        "remote_hit_ratio": float(counts.get(Verdict.REMOTE_HIT.value, 0) / n) if n else None,
        "bytes_read": sums["bytes_read"],
        "reused_tokens": sums["reused_tokens"],
        "recomputed_tokens": sums["recomputed_tokens"],
        # The host path: what the offloading tiers served (docs/host_copy.md).
        "host_hit_ratio": float(counts.get(Verdict.HOST_HIT.value, 0) / n) if n else None,
        "host_path_turns": int(sum(counts.get(v, 0) for v in HOST_VERDICTS)),
        "host_bytes_loaded": sums["host_bytes_loaded"],
        "host_reused_tokens": sums["host_reused_tokens"],
        # TTFT and latency apart: a turn can be slow after its first token (decode).
        "ttft_p50_s": ttft[0],
        "ttft_p95_s": ttft[1],
        "ttft_unmeasured_turns": ttft_unmeasured,
        "latency_p50_s": latency[0],
        "latency_p95_s": latency[1],
    }


def _sorted_codes(values: pd.Series) -> tuple[np.ndarray, list]:
    """Per row the code of its value (-1: missing) and the values in sort order."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        return values.cat.codes.to_numpy(np.int64), list(values.cat.categories)
    codes, uniques = pd.factorize(values, sort=True)
    return codes.astype(np.int64), list(uniques)


def _quantiles(values: np.ndarray) -> tuple[float | None, float | None]:
    """p50 and p95 of the measured values (one partition for both)."""
    values = values[~np.isnan(values)]
    if not len(values):
        return None, None
    p50, p95 = np.quantile(values, (0.5, 0.95))
    return float(p50), float(p95)


def _grouped(
    measured: Measured, turns: pd.DataFrame, keys: list[str], rows: np.ndarray
) -> list[dict[str, Any]]:
    """``_metrics`` per combination of ``keys`` found among ``rows``, sorted as
    ``groupby`` sorts (a categorical by category order); rows with a missing key belong
    to no group."""
    coded = [_sorted_codes(turns[key]) for key in keys]
    categories = [names for _, names in coded]
    codes = [key_codes.take(rows) for key_codes, _ in coded]
    combined = np.zeros(len(rows), np.int64)
    for key_codes, names in zip(codes, categories):
        combined = combined * len(names) + key_codes
    valid = np.logical_and.reduce([key_codes >= 0 for key_codes in codes])
    rows, combined = rows[valid], combined[valid]
    # Each group's rows in table order; few groups: 16-bit codes sort by radix, ~5x faster.
    small = combined.astype(np.int16) if len(combined) and combined.max() < 2**15 else combined
    order = np.argsort(small, kind="stable")
    ordered = combined[order]
    starts = np.flatnonzero(run_starts(ordered))
    uniques = ordered[starts]
    out = []
    for value, group in zip(uniques, np.split(rows[order], starts[1:])):
        key = []
        for names in reversed(categories):
            value, code = divmod(int(value), len(names))
            key.append(names[code])
        out.append({**dict(zip(keys, reversed(key))), **_metrics(measured, group)})
    return out


def phase_ranking(
    turns: pd.DataFrame,
    rows: np.ndarray,
    slowest: dict[str, int],
    unmeasured: tuple[np.ndarray, np.ndarray],
) -> dict[str, Any]:
    """Where the time of the turns at positions ``rows`` went: per phase its seconds
    summed over turns, its share of their summed latency, p50/p95 seconds per turn (over
    turns that measured it alone; 0 when a turn did not take the step) and
    ``slowest_turns`` (turns where it was the slowest phase), ranked by total seconds,
    largest first. ``unmeasured_s``: the latency no phase measured alone holds
    (``unmeasured_latency``), so the phases' shares and its share add up to 1;
    ``unmeasured_turns``: turns with such a phase."""
    latency = turns["latency_s"].to_numpy(float).take(rows)
    timed = ~np.isnan(latency)
    latency_ns = sum_ns(latency[timed])
    phases = []
    for phase in PHASES:
        seconds = turns[phase_column(phase)].to_numpy(float).take(rows)
        values = seconds[~np.isnan(seconds)]
        phases.append(
            phase_row(phase.value, sum_ns(values), len(values), _quantiles(values), slowest)
        )
    seconds, gaps = (values.take(rows)[timed] for values in unmeasured)
    return ranking(
        len(rows), int(timed.sum()), latency_ns, sum_ns(seconds), int(gaps.sum()), phases
    )


def phase_row(
    phase: str,
    total_ns: int,
    measured: int,
    quantiles: tuple[float | None, float | None],
    slowest: dict[str, int],
) -> dict[str, Any]:
    """One phase's row of a ranking (its ``share`` filled by ``ranking``)."""
    return {
        "phase": phase,
        "total_s": total_ns / 1e9,
        "total_ns": total_ns,
        "p50_s": quantiles[0],
        "p95_s": quantiles[1],
        "slowest_turns": slowest.get(phase, 0),
        "measured_turns": measured,
    }


def ranking(
    turns: int, timed: int, latency_ns: int, gap_ns: int, gap_turns: int, phases: list[dict]
) -> dict[str, Any]:
    """``phase_ranking``'s section from its sums (exact nanoseconds) and phase rows."""
    for row in phases:
        total_ns = row.pop("total_ns")
        row["share"] = total_ns / latency_ns if latency_ns else None
    phases = [{k: row[k] for k in _PHASE_ROW_ORDER} for row in phases]
    phases.sort(key=lambda row: -row["total_s"])  # stable: Phase order among equals
    return {
        "turns": turns,
        "timed_turns": timed,
        "latency_s": latency_ns / 1e9,
        "unmeasured_s": gap_ns / 1e9,
        "unmeasured_share": gap_ns / latency_ns if latency_ns else None,
        "unmeasured_turns": gap_turns,
        "phases": phases,
    }


_PHASE_ROW_ORDER = (
    "phase",
    "total_s",
    "share",
    "p50_s",
    "p95_s",
    "slowest_turns",
    "measured_turns",
)


def sum_ns(seconds: np.ndarray) -> int:
    """Seconds summed as integer nanoseconds: exact, so a total does not depend on row
    order (the store and ClickHouse hand the same turns in different orders)."""
    return int(np.rint(seconds * 1e9).astype(np.int64).sum())


def unmeasured_latency(turns: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per turn, the latency that no phase measured alone holds (phases merged around a
    missing span) and whether the turn has such a phase. Exactly 0 s when every phase
    was measured alone, so the float rounding of unix-second marks never shows as
    unmeasured time."""
    measured = np.zeros(len(turns))
    gaps = np.zeros(len(turns), bool)
    for phase in PHASES:
        seconds = turns[phase_column(phase)].to_numpy(float)
        missing = np.isnan(seconds)
        gaps |= missing
        measured += np.where(missing, 0.0, seconds)
    latency = turns["latency_s"].to_numpy(float)
    return np.where(gaps, latency - measured, 0.0), gaps


def phase_sections(turns: pd.DataFrame, first: np.ndarray) -> dict[str, Any]:
    """``phase_ranking`` of turn 1 and of later turns: never one average, turn 1 has
    nothing to reuse and its phases differ in kind."""
    codes, names = pd.factorize(turns["slowest_phase"])  # once; a bincount per scope
    unmeasured = unmeasured_latency(turns)

    def slowest(rows: np.ndarray) -> dict[str, int]:
        scoped = codes.take(rows)
        counts = np.bincount(scoped[scoped >= 0], minlength=len(names))
        return {str(name): int(n) for name, n in zip(names, counts)}

    # Row positions, not masks: 17 columns are taken per scope, and take is ~3x faster.
    scopes = {"first_turn": np.flatnonzero(first), "later_turns": np.flatnonzero(~first)}
    return {
        scope: phase_ranking(turns, rows, slowest(rows), unmeasured)
        for scope, rows in scopes.items()
    }


def memory_held(turns: pd.DataFrame) -> dict[str, Any]:
    """D's memory held for reuse: blocks x time until release, and how much was read."""
    return memory_result(memory_sums(turns), bytes_per_block(turns))


def memory_sums(turns: pd.DataFrame) -> dict[str, float]:
    """``memory_held``'s sums over some turns: added up over batches, they are the
    fleet's."""
    blocks = turns["export_blocks"].astype(float)
    held = turns["held_s"].astype(float)
    measured = (turns["release_end_ns"].astype(float) - turns["export_end_ns"].astype(float)) / 1e9
    held = held.fillna(measured)
    known = blocks.notna() & held.notna()
    read = (turns["release_reason"] == ReleaseReason.READ.value).fillna(False) | (
        turns["release_read_count"].astype(float) > 0
    ).fillna(False)
    return {
        "exports": int(blocks.notna().sum()),
        "exports_released": int(known.sum()),
        "exports_read": int((known & read).sum()),
        "blocks_exported": float(blocks.sum()),
        "blocks_released": float(blocks[known].sum()),
        "blocks_read": float(blocks[known & read].sum()),
        "block_seconds": float((blocks * held)[known].sum()),
        "read_block_seconds": float((blocks * held)[known & read].sum()),
    }


def memory_result(sums: dict[str, float], per_block: float | None) -> dict[str, Any]:
    """``memory_held`` from ``memory_sums`` and the bytes one block weighs."""
    block_seconds, read_block_seconds = sums["block_seconds"], sums["read_block_seconds"]
    out = {
        "exports": sums["exports"],
        "exports_released": sums["exports_released"],
        "exports_read": sums["exports_read"],
        "blocks_exported": int(sums["blocks_exported"]),
        "blocks_read": int(sums["blocks_read"]),
        "block_seconds_held": block_seconds,
        "block_seconds_held_then_read": read_block_seconds,
        "block_seconds_never_read": block_seconds - read_block_seconds,
        "read_share_of_blocks": (
            sums["blocks_read"] / sums["blocks_released"] if sums["blocks_released"] else None
        ),
        "bytes_per_block": per_block,
    }
    if per_block:
        out["gib_hours_held"] = block_seconds * per_block / 2**30 / 3600
    return out


# --------------------------------------------------------------------------- drill-down

# The turns a report lists to follow up (``drill_down``): every fault up to this many, then
# the slowest healthy turns; the rest are counted.
LISTED_FAULTS = 50
LISTED_SLOW = 20
# Conversations whose trace ids are looked up in the source (one read each).
TRACE_LOOKUPS = 40


def diagnose_command(
    source: str, conversation_id: str, tenant: str | None = None, read_slo_s: float | None = None
) -> str:
    """The exact ``kvobs diagnose`` command line for a conversation, shell-quoted (an id
    that starts with ``-`` comes after ``--``).

    >>> diagnose_command("out/my demo", "agent-happy")
    "kvobs diagnose agent-happy --source 'out/my demo'"
    >>> diagnose_command("s", "-x;rm", "ab12", 0.5)
    "kvobs diagnose --source s --tenant ab12 --read-slo 0.5 -- '-x;rm'"
    """
    options = ["--source", source]
    if tenant:
        options += ["--tenant", tenant]
    if read_slo_s is not None:
        options += ["--read-slo", f"{read_slo_s:g}"]
    words = (
        options + ["--", conversation_id]
        if conversation_id.startswith("-")
        else [conversation_id] + options
    )
    return shlex.join(["kvobs", "diagnose", *words])


def drill_down(
    labelled: pd.DataFrame,
    source: str,
    read_slo_s: float | None = None,
    faults: int = LISTED_FAULTS,
    slow: int = LISTED_SLOW,
) -> dict[str, Any]:
    """The turns to follow up: every turn with a fault verdict (the slowest first, up to
    ``faults``), then healthy turns at or above their scope's latency p95 (turn 1 and
    later turns apart; up to ``slow``). Each row: conversation, tenant, turn, verdict,
    latency, top latency cause (``kvobs.causes``) and its share, the ``kvobs diagnose``
    command; ``trace_id`` stays None until ``add_trace_ids`` reads the source."""
    from kvobs.causes import causes, decode_context
    from kvobs.verdicts import Turn

    latency = labelled["latency_s"].to_numpy(float, na_value=np.nan)
    first = (labelled["turn"] == 1).to_numpy(bool)
    verdicts = labelled["verdict"]
    fault = (verdicts.notna() & ~verdicts.isin(NOT_FAULT_VALUES)).to_numpy(bool)
    p95 = np.full(len(labelled), np.inf)
    for scope in (first, ~first):
        measured = latency[scope & ~np.isnan(latency)]
        if len(measured):
            p95[scope] = np.quantile(measured, 0.95)
    is_slow = ~fault & (latency >= p95)  # NaN compares False
    cids, tenants, turns = (labelled[c] for c in ("conversation_id", "tenant", "turn"))

    def ranked(mask: np.ndarray, limit: int) -> list[int]:
        """The ``limit`` slowest rows of ``mask`` (unmeasured last); ties by conversation
        and turn, so that every source lists the same turns."""
        rows = np.flatnonzero(mask)
        key = np.nan_to_num(latency[rows], nan=-1.0)
        if len(rows) > limit:  # the candidates: every row as slow as the limit-th
            kth = np.partition(key, len(key) - limit)[len(key) - limit]
            rows, key = rows[key >= kth], key[key >= kth]
        order = sorted(
            range(len(rows)),
            key=lambda j: (
                -key[j],
                str(cids.iat[rows[j]]),
                str(tenants.iat[rows[j]]),
                int(turns.iat[rows[j]]),
            ),
        )
        return [int(rows[j]) for j in order[:limit]]

    chosen = [(i, "fault") for i in ranked(fault, faults)] + [
        (i, "slow") for i in ranked(is_slow, slow)
    ]
    rows = []
    if chosen:
        shared = labelled.groupby("conversation_id", observed=True)["tenant"].nunique()
        context = decode_context(labelled)
        records = labelled.iloc[[i for i, _ in chosen]].to_dict("records")
        for (i, kind), record in zip(chosen, records):
            turn = Turn(record).as_dict()
            found = causes(turn, context)
            cid, tenant = str(record["conversation_id"]), str(record["tenant"] or "")
            rows.append(
                {
                    "kind": kind,
                    "conversation_id": cid,
                    "tenant": tenant,
                    "turn": int(record["turn"]),
                    "verdict": str(record["verdict"]),
                    "latency_s": None if np.isnan(latency[i]) else float(latency[i]),
                    "top_cause": found[0].cause.value if found else None,
                    "top_cause_share": found[0].share if found else None,
                    "trace_id": None,
                    "command": diagnose_command(
                        source, cid, tenant if shared.get(cid, 1) > 1 else None, read_slo_s
                    ),
                }
            )
    return {
        "fault_turns": int(fault.sum()),
        "slow_turns": int(is_slow.sum()),
        "slow_threshold": "latency at or above its scope's p95 (turn 1, later turns)",
        "rows": rows,
    }


def add_trace_ids(drill: dict[str, Any], span_source, lookups: int = TRACE_LOOKUPS) -> None:
    """Fill each listed turn's trace id (the proxy's turn span's) from the source: one
    read per conversation, as ``kvobs diagnose`` reads it, for at most ``lookups``
    conversations. An id-less turn's id names its trace (``anonymous:<trace id>``)."""
    from kvobs.turns.correlate import turns_from_spans

    wanted: dict[str, list[dict]] = {}
    for row in drill["rows"]:
        cid = row["conversation_id"]
        if cid.startswith(sc.ANONYMOUS_PREFIX):
            row["trace_id"] = sc.trace_of_anonymous(cid)
        elif not cid.startswith(sc.LINEAGE_PREFIX):
            wanted.setdefault(cid, []).append(row)
    for cid, rows in list(wanted.items())[:lookups]:
        try:
            found = turns_from_spans(span_source.span_table(cid), frame=False)
        except Exception:  # noqa: BLE001 - a trace id is a convenience, never a failure
            continue
        if "trace_id" not in found.column_names:
            continue
        keys = zip(
            *(
                found.column(c).to_pylist()
                for c in ("conversation_id", "tenant", "turn", "trace_id")
            )
        )
        trace = {(str(c), str(t or ""), int(n)): tid for c, t, n, tid in keys}
        for row in rows:
            row["trace_id"] = trace.get((cid, row["tenant"], row["turn"]))


@dataclass
class FleetReport:
    source: str
    since: str | None
    conversations: int
    turns: int
    prefill_tokens_per_s: float | None
    first_turn: dict[str, Any]
    later_turns: dict[str, Any]
    by_turn: list[dict[str, Any]]
    by_prompt: list[dict[str, Any]]
    by_turn_and_prompt: list[dict[str, Any]]
    memory: dict[str, Any]
    phases: dict[str, Any] = field(default_factory=dict)  # phase_sections
    retention: dict[str, Any] = field(default_factory=dict)  # fleet.retention.retention
    synthetic: bool = False
    extras: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "extras"}

    @property
    def verdicts(self) -> list[Verdict]:
        mix = {**self.first_turn["verdicts"], **self.later_turns["verdicts"]}
        return [Verdict(v) for v in mix]


def build_report(
    turns: pd.DataFrame,
    source: str = "",
    since: str | None = None,
    prefill_tokens_per_s: float | None = None,
    read_slo_s: float | None = None,
) -> tuple[FleetReport, pd.DataFrame]:
    """The report, and the labelled turn table it was computed from (for plots)."""
    labelled, rate = label_turns(turns, prefill_tokens_per_s, read_slo_s)
    cutoff = since_cutoff_ns(labelled["turn_start_ns"].max(), since)
    if cutoff is not None:
        labelled = labelled[(labelled["turn_start_ns"] >= cutoff).fillna(False)]
    first = (labelled["turn"] == 1).to_numpy(bool)
    every, later = np.arange(len(labelled)), np.flatnonzero(~first)
    cids = labelled["conversation_id"]
    # The costs in a second thread, the verdicts and latencies here: both only read the
    # labelled table, and numpy lets go of the GIL in its sorts, partitions and takes
    # (two cores, 1.35M turns: 5.45 s instead of 5.82, mean of 3 alternated runs).
    with ThreadPoolExecutor(max_workers=1) as pool:
        costs = pool.submit(
            lambda: (memory_held(labelled), phase_sections(labelled, first), retention(labelled))
        )
        measured = Measured.of(labelled)
        mix: dict[str, Any] = {  # FleetReport's first_turn/later_turns and by_* fields
            "first_turn": _metrics(measured, np.flatnonzero(first)),
            "later_turns": _metrics(measured, later),
            "by_turn": _grouped(measured, labelled, ["turn_bucket"], every),
            "by_prompt": _grouped(measured, labelled, ["prompt_bucket"], later),
            "by_turn_and_prompt": _grouped(
                measured, labelled, ["turn_bucket", "prompt_bucket"], every
            ),
        }
        memory, phases, retained = costs.result()
    report = FleetReport(
        source=source,
        since=since,
        conversations=len(labelled[CONVERSATION_KEYS].drop_duplicates()),
        turns=len(labelled),
        prefill_tokens_per_s=rate,
        **mix,
        memory=memory,
        phases=phases,
        retention=retained,
        synthetic=bool(len(cids) and str(cids.iloc[0]).startswith("synthetic-")),
    )
    report.extras["drill_down"] = drill_down(labelled, source, read_slo_s)
    return report, labelled
