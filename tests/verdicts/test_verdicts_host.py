"""Host-path verdicts from host spans written through the real SDK/exporter and read back.

Each conversation is what one engine with the instrumented offloading connector emits
(no proxy, no NIXL): turn 1's lookup and the copy it saved, maybe that copy's eviction,
turn 2's lookup and load. Block: 16 tokens.
"""

from __future__ import annotations

import pytest

from kvobs import semconv as sc
from kvobs.diagnose import diagnose
from kvobs.emit.spans import Correlation, emit
from kvobs.semconv import Verdict
from kvobs.sources import open_source
from spanfactory import Tracers

T0 = 1_700_000_000 * 10**9
S = 10**9


def _lookup(decode, corr, at_ns, prompt, local=0, accepted=0, tier="host"):
    emit(decode, sc.SPAN_HOST_LOOKUP, corr, {
        sc.REQUEST_ID.key: f"r{corr.turn}", sc.PROMPT_TOKENS.key: prompt,
        sc.HOST_LOCAL_TOKENS.key: local, sc.HOST_HIT_TOKENS.key: accepted,
        sc.HOST_ACCEPTED_TOKENS.key: accepted,
        sc.HOST_HIT_HOST.key: accepted if tier == "host" else 0,
        sc.HOST_HIT_P2P.key: accepted if tier == "p2p" else 0, sc.HOST_HIT_OTHER.key: 0},
        at_ns, at_ns)


def _save(decode, corr, at_ns, saved, prompt, output, covers, refused=0):
    emit(decode, sc.SPAN_HOST_SAVE, corr, {
        sc.REQUEST_ID.key: f"r{corr.turn}", sc.HOST_BLOCKS.key: saved // 16,
        sc.HOST_SAVED_TOKENS.key: saved, sc.HOST_BYTES.key: saved // 16 * 65536,
        sc.HOST_DURATION.key: 0.001, sc.HOST_COVERS_RESPONSE.key: covers,
        sc.HOST_SAVE_INCOMPLETE.key: refused > 0, sc.HOST_REFUSED_BLOCKS.key: refused,
        sc.HOST_PROMPT_TOKENS.key: prompt, sc.HOST_OUTPUT_TOKENS.key: output,
        sc.HOST_COPY_ENGINE.key: sc.CopyEngine.HOST_MEMCPY.value}, at_ns, at_ns + S // 100)


def write(tracers, cid, *, saved=80, covers=True, accepted=80, evict_at_s=None,
          load=True, prompt2=140, tier="host", refused=0):
    decode = tracers[sc.Service.DECODE]
    first, second = Correlation(cid, 1), Correlation(cid, 2)
    _lookup(decode, first, T0, 60)
    _save(decode, first, T0 + S, saved, 60, 21, covers, refused)
    if evict_at_s is not None:
        emit(decode, sc.SPAN_HOST_EVICT, first, {
            sc.HOST_BLOCKS.key: saved // 16, sc.HOST_EVICTED_BY.key: "filler",
            sc.REQUEST_ID.key: "r1", sc.HOST_EVICTED_AGE_MIN.key: evict_at_s - 1.0,
            sc.HOST_EVICTED_AGE_MAX.key: evict_at_s - 1.0},
            T0 + int(evict_at_s * S), T0 + int(evict_at_s * S))
    _lookup(decode, second, T0 + 10 * S, prompt2, accepted=accepted, tier=tier)
    if load and accepted:
        emit(decode, sc.SPAN_HOST_LOAD, second, {
            sc.REQUEST_ID.key: "r2", sc.HOST_BYTES.key: accepted // 16 * 65536,
            sc.HOST_BLOCKS.key: accepted // 16, sc.HOST_DURATION.key: 0.002,
            sc.HOST_TIER.key: tier, sc.HOST_COPY_ENGINE.key: "host-memcpy"},
            T0 + 10 * S, T0 + 10 * S + 2 * 10**6)


CASES = {
    "hit": (dict(), Verdict.HOST_HIT),
    # pulled from a peer's host tier (configuration (b)): a host hit, by the p2p tier
    "p2p-hit": (dict(tier="p2p"), Verdict.HOST_HIT),
    "evicted": (dict(accepted=0, evict_at_s=5), Verdict.HOST_EVICTED),
    "evicted-part": (dict(accepted=32, evict_at_s=5), Verdict.HOST_EVICTED),
    "prompt-only": (dict(saved=48, covers=False, accepted=48), Verdict.HOST_COPY_LACKS_RESPONSE),
    # the copy left the tier after this turn's lookup: that eviction explains nothing here
    "evicted-later": (dict(evict_at_s=12), Verdict.HOST_HIT),
    # a prompt-only copy but the turn reused past the prompt (its own local prefix)
    "prompt-only-but-hit": (dict(saved=48, covers=False, accepted=80), Verdict.HOST_HIT),
    # the tier refused all 5 blocks of turn 1 (no room): nothing to load
    "save-refused": (dict(saved=0, covers=False, accepted=0, refused=5),
                     Verdict.HOST_SAVE_INCOMPLETE),
    # it refused the response's block: the copy ends at the prompt, yet not by
    # offload_prompt_only, so not host-copy-lacks-response
    "save-refused-tail": (dict(saved=48, covers=False, accepted=48, refused=2),
                          Verdict.HOST_SAVE_INCOMPLETE),
    # a refusal that a retry made good, or reuse past it: the turn lost nothing
    "save-refused-but-reused": (dict(saved=80, accepted=96, refused=1), Verdict.HOST_HIT),
    # evicted after an incomplete save: the eviction is the stronger fact
    "save-refused-then-evicted": (dict(saved=48, covers=False, accepted=0, refused=2,
                                       evict_at_s=5), Verdict.HOST_EVICTED),
}


def write_cases(path: str) -> str:
    """Every case's conversation in a store at ``path`` (the fleet views' tests read
    them too)."""
    tracers = Tracers(path)
    for name, (kwargs, _) in CASES.items():
        write(tracers, name, **kwargs)
    tracers.flush()
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return open_source(write_cases(str(tmp_path_factory.mktemp("host-store"))))


@pytest.mark.parametrize("name", list(CASES))
def test_turn_two_host_verdict(store, name):
    first, second = diagnose(store, name).turns
    assert first.finding.verdict is Verdict.FIRST_TURN
    assert second.finding.verdict is CASES[name][1]


def test_host_hit_evidence(store):
    finding = diagnose(store, "hit").turns[1].finding
    assert finding.evidence["host_accepted_tokens"] == 80
    assert finding.evidence["host_hit_host_tokens"] == 80
    assert finding.evidence["host_load_bytes"] == 5 * 65536
    assert finding.evidence["host_copy_engine"] == "host-memcpy"
    assert finding.remedy == "80 prompt tokens came from the host tier in 2.0 ms; nothing to do."


def test_p2p_hit_says_the_load_time_leaves_out_the_pull(store):
    finding = diagnose(store, "p2p-hit").turns[1].finding
    assert finding.evidence["host_hit_p2p_tokens"] == 80
    assert finding.evidence["host_load_tier"] == "p2p"
    assert finding.remedy.startswith("80 prompt tokens were pulled from a peer's host tier "
                                     "(p2p tier) and loaded in 2.0 ms")
    assert "kv_offload_tiering_read_time" in finding.remedy


def test_host_evicted_evidence_and_remedy(store):
    finding = diagnose(store, "evicted").turns[1].finding
    assert finding.evidence["prev_host_saved_tokens"] == 80
    assert finding.evidence["prev_host_evicted_blocks"] == 5
    assert finding.evidence["prev_host_evicted_age_s"] == pytest.approx(4.0)
    assert "evicted after 4.0s in the tier" in finding.remedy
    assert "cpu_bytes_to_use" in finding.remedy


def test_lacks_response_remedy(store):
    finding = diagnose(store, "prompt-only").turns[1].finding
    assert finding.evidence["prev_host_save_output_tokens"] == 21
    assert finding.evidence["prev_host_covers_response"] is False
    assert "offload_prompt_only: false" in finding.remedy


def test_save_incomplete_evidence_and_remedy(store):
    finding = diagnose(store, "save-refused-tail").turns[1].finding
    assert finding.evidence["prev_host_save_incomplete"] is True
    assert finding.evidence["prev_host_refused_blocks"] == 2
    assert finding.evidence["prev_host_saved_tokens"] == 48
    assert finding.evidence["host_accepted_tokens"] == 48
    assert "refused 2 blocks" in finding.remedy and "cpu_bytes_to_use" in finding.remedy
    assert "reused 48" in finding.remedy
