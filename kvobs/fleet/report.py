"""The fleet report: verdict mix, reuse, bytes, TTFT, latency and D's retained memory, by
turn index and prompt length, the phases that cost the fleet most (``phase_ranking``) and
the retention cost on D and in the host tier (``kvobs.fleet.retention``), over every turn
of a source; turn 1 always apart."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvobs import columns as col
from kvobs import semconv as sc
from kvobs.fleet.retention import host_tokens_served, retention
from kvobs.fleet.since import since_cutoff_ns
from kvobs.turn_columns import CONVERSATION_KEYS
from kvobs.timeline import PHASES, add_timeline, phase_column
from kvobs.verdicts import classify_frame
from kvobs.semconv import ReadOutcome, ReleaseReason, Verdict

VERDICTS = [v.value for v in Verdict]


def label_turns(turns: pd.DataFrame, prefill_tokens_per_s: float | None = None,
                read_slo_s: float | None = None) -> tuple[pd.DataFrame, float | None]:
    """Turn table plus its timeline (``kvobs.timeline``), ``verdict``, ``turn_bucket``
    and ``prompt_bucket`` columns."""
    turns, _, rate = add_timeline(turns, prefill_tokens_per_s)
    turns["verdict"] = classify_frame(turns, rate, read_slo_s).to_numpy()
    turns["turn_bucket"] = _buckets(turns["turn"], sc.turn_bucket, sc.TURN_BUCKET_VALUES)
    prompt = np.nan_to_num(prompt_tokens(turns), nan=-1).astype(np.int64)
    labels = _buckets(pd.Series(prompt), sc.prompt_bucket, sc.PROMPT_BUCKET_VALUES)
    turns["prompt_bucket"] = labels.where(prompt >= 0).to_numpy()
    return turns, rate


def prompt_tokens(turns: pd.DataFrame) -> np.ndarray:
    """Per turn, its prompt length: P's pull decision's, else (an engine with only the
    offloading connector: no P) its host lookup's; NaN when neither says."""
    return np.where(col.present(turns, "prompt_tokens"), col.num(turns, "prompt_tokens"),
                    col.num(turns, "host_lookup_prompt_tokens"))


def _buckets(values: pd.Series, label, order) -> pd.Series:
    """Bucket labels as categorical codes: one label call per distinct value, no
    per-turn strings."""
    uniques, inverse = np.unique(values.to_numpy(np.int64), return_inverse=True)
    position = {name: i for i, name in enumerate(order)}
    codes = np.array([position.get(label(int(u)), -1) for u in uniques], np.int64)
    return pd.Series(pd.Categorical.from_codes(codes[inverse], categories=list(order)),
                     index=values.index)


METRIC_COLUMNS = ["verdict", "read_outcome", "read_bytes", "candidate_tokens",
                  "recomputed_tokens", "ttft_s", "latency_s"]
# The host path's (kvobs.host.* spans); a turn table of an older kvobs may lack them.
HOST_METRIC_COLUMNS = ["host_load_bytes", "host_hit_host_tokens", "host_hit_p2p_tokens"]
# Verdicts of the host path, counted apart in each scope's ``host_hit_ratio``.
HOST_VERDICTS = [v.value for v in (Verdict.HOST_HIT, Verdict.HOST_EVICTED,
                                   Verdict.HOST_SAVE_INCOMPLETE,
                                   Verdict.HOST_COPY_LACKS_RESPONSE)]


def _metrics(group: pd.DataFrame) -> dict[str, Any]:
    n = len(group)
    counts = group["verdict"].value_counts()
    done = (group["read_outcome"] == ReadOutcome.DONE.value).fillna(False)
    ttft = group["ttft_s"].astype(float)
    latency = group["latency_s"].astype(float)
    return {
        "turns": n,
        "verdicts": {v: int(counts.get(v, 0)) for v in VERDICTS if counts.get(v, 0)},
        "remote_hit_ratio": float(counts.get(Verdict.REMOTE_HIT.value, 0) / n) if n else None,
        "bytes_read": int(group.loc[done, "read_bytes"].astype(float).sum()),
        "reused_tokens": int(group.loc[done, "candidate_tokens"].astype(float).sum()),
        "recomputed_tokens": int(group["recomputed_tokens"].astype(float).sum()),
        # The host path: what the offloading tiers served (docs/host_copy.md).
        "host_hit_ratio": float(counts.get(Verdict.HOST_HIT.value, 0) / n) if n else None,
        "host_path_turns": int(sum(counts.get(v, 0) for v in HOST_VERDICTS)),
        "host_bytes_loaded": int(np.nansum(col.num(group, "host_load_bytes"))),
        "host_reused_tokens": int(host_tokens_served(group).sum()),
        # TTFT and latency apart: a turn can be slow after its first token (decode).
        "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p95_s": _quantile(ttft, 0.95),
        "ttft_unmeasured_turns": int(ttft.isna().sum()),
        "latency_p50_s": _quantile(latency, 0.5), "latency_p95_s": _quantile(latency, 0.95),
    }


def _quantile(values: pd.Series, q: float) -> float | None:
    values = values.dropna()
    return float(values.quantile(q)) if len(values) else None


def phase_ranking(turns: pd.DataFrame, rows: np.ndarray, slowest: dict[str, int],
                  unmeasured: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """Where the time of the turns at positions ``rows`` went: per phase its seconds
    summed over turns, its share of their summed latency, p50/p95 seconds per turn (over
    turns that measured it alone; 0 when a turn did not take the step) and
    ``slowest_turns`` (turns where it was the slowest phase), ranked by total seconds,
    largest first. ``unmeasured_s``: the latency no phase measured alone holds
    (``unmeasured_latency``), so the phases' shares and its share add up to 1;
    ``unmeasured_turns``: turns with such a phase."""
    latency = turns["latency_s"].to_numpy(float).take(rows)
    timed = ~np.isnan(latency)
    latency_ns = _sum_ns(latency[timed])
    phases = [_phase_row(turns[phase_column(phase)].to_numpy(float).take(rows), phase.value,
                         latency_ns, slowest) for phase in PHASES]
    phases.sort(key=lambda row: -row["total_s"])  # stable: Phase order among equals
    seconds, gaps = (values.take(rows)[timed] for values in unmeasured)
    gap_ns = _sum_ns(seconds)
    return {"turns": len(rows), "timed_turns": int(timed.sum()),
            "latency_s": latency_ns / 1e9, "unmeasured_s": gap_ns / 1e9,
            "unmeasured_share": gap_ns / latency_ns if latency_ns else None,
            "unmeasured_turns": int(gaps.sum()), "phases": phases}


def _phase_row(seconds: np.ndarray, phase: str, latency_ns: int,
               slowest: dict[str, int]) -> dict[str, Any]:
    values = seconds[~np.isnan(seconds)]
    total_ns = _sum_ns(values)
    p50, p95 = (float(q) for q in np.quantile(values, (0.5, 0.95))) if len(values) else (
        None, None)
    return {"phase": phase, "total_s": total_ns / 1e9,
            "share": total_ns / latency_ns if latency_ns else None, "p50_s": p50,
            "p95_s": p95, "slowest_turns": slowest.get(phase, 0),
            "measured_turns": len(values)}


def _sum_ns(seconds: np.ndarray) -> int:
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
    return {scope: phase_ranking(turns, rows, slowest(rows), unmeasured)
            for scope, rows in scopes.items()}


def memory_held(turns: pd.DataFrame) -> dict[str, Any]:
    """D's memory held for reuse: blocks x time until release, and how much was read."""
    blocks = turns["export_blocks"].astype(float)
    held = turns["held_s"].astype(float)
    measured = (turns["release_end_ns"].astype(float) - turns["export_end_ns"].astype(float)) / 1e9
    held = held.fillna(measured)
    known = blocks.notna() & held.notna()
    read = ((turns["release_reason"] == ReleaseReason.READ.value).fillna(False)
            | (turns["release_read_count"].astype(float) > 0).fillna(False))
    block_seconds = float((blocks * held)[known].sum())
    read_block_seconds = float((blocks * held)[known & read].sum())
    done = (turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False)
    per_block = (turns.loc[done, "read_bytes"].astype(float)
                 / turns.loc[done, "read_blocks"].astype(float)).replace(np.inf, np.nan)
    bytes_per_block = float(per_block.median()) if per_block.notna().any() else None
    out = {
        "exports": int(blocks.notna().sum()),
        "exports_released": int(known.sum()),
        "exports_read": int((known & read).sum()),
        "blocks_exported": int(blocks.sum()),
        "blocks_read": int(blocks[known & read].sum()),
        "block_seconds_held": block_seconds,
        "block_seconds_held_then_read": read_block_seconds,
        "block_seconds_never_read": block_seconds - read_block_seconds,
        "read_share_of_blocks": (float(blocks[known & read].sum() / blocks[known].sum())
                                 if blocks[known].sum() else None),
        "bytes_per_block": bytes_per_block,
    }
    if bytes_per_block:
        out["gib_hours_held"] = block_seconds * bytes_per_block / 2**30 / 3600
    return out


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


def build_report(turns: pd.DataFrame, source: str = "", since: str | None = None,
                 prefill_tokens_per_s: float | None = None,
                 read_slo_s: float | None = None) -> tuple[FleetReport, pd.DataFrame]:
    """The report, and the labelled turn table it was computed from (for plots)."""
    labelled, rate = label_turns(turns, prefill_tokens_per_s, read_slo_s)
    cutoff = since_cutoff_ns(labelled["turn_start_ns"].max(), since)
    if cutoff is not None:
        labelled = labelled[(labelled["turn_start_ns"] >= cutoff).fillna(False)]
    # The grouped metrics read a few columns: slicing those only keeps the per-group
    # copies small (a million turns, ~40 columns).
    measured = labelled[["turn", "turn_bucket", "prompt_bucket", *METRIC_COLUMNS,
                         *(c for c in HOST_METRIC_COLUMNS if c in labelled)]]
    first = measured["turn"] == 1
    later = measured[~first]

    def grouped(frame, keys):
        rows = []
        for key, group in frame.groupby(keys, observed=True, sort=True):
            key = key if isinstance(key, tuple) else (key,)
            rows.append({**dict(zip(keys, key)), **_metrics(group)})
        return rows

    cids = labelled["conversation_id"]
    report = FleetReport(
        source=source, since=since,
        conversations=len(labelled[CONVERSATION_KEYS].drop_duplicates()), turns=len(labelled),
        prefill_tokens_per_s=rate, first_turn=_metrics(measured[first]),
        later_turns=_metrics(later),
        by_turn=grouped(measured, ["turn_bucket"]),
        by_prompt=grouped(later, ["prompt_bucket"]),
        by_turn_and_prompt=grouped(measured, ["turn_bucket", "prompt_bucket"]),
        memory=memory_held(labelled),
        phases=phase_sections(labelled, first.to_numpy(bool)),
        retention=retention(labelled),
        synthetic=bool(len(cids) and str(cids.iloc[0]).startswith("synthetic-")))
    return report, labelled
