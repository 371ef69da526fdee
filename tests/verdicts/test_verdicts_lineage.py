"""Verdicts and remedies that rest on the export a prompt extends (kvobs.turns.lineage) and on
the proxy's miss reasons: each case a one-row turn table, each remedy naming its cause."""

from __future__ import annotations

import pandas as pd
import pytest

from kvobs.verdicts import findings

LINKED = {"extends_request_id": "d-1", "extends_span_id": "s-1", "extends_engine_id": "eng-A",
          "extends_endpoint": "d:5600", "extends_tokens": 400,
          "extends_verified_tokens": 384, "extends_exported_at": 100.0}


def finding(**row):
    base = {"turn": 2, "conversation_id": "c", "tenant": ""}
    return findings(pd.DataFrame([{**base, **row}]))[0]


def test_behind_another_router_a_live_export_is_missing_metadata_naming_it():
    f = finding(decision="no-params", extends_live=True, extends_ttl_left_s=12.5, **LINKED)
    assert f.verdict.value == "missing-metadata"
    assert "router did not forward" in f.remedy
    assert "eng-A" in f.remedy and "d-1" in f.remedy and "400 tokens" in f.remedy
    assert "12.5s of TTL left" in f.remedy
    assert f.evidence["extends_request_id"] == "d-1"


def test_behind_another_router_a_lapsed_export_is_expired():
    f = finding(decision="no-params", extends_live=False, extends_ttl_left_s=-3.0, **LINKED)
    assert f.verdict.value == "expired"
    assert "gone" in f.remedy and "expired 3.0s earlier" in f.remedy


def test_without_lookup_or_link_the_lookup_is_needed():
    f = finding(decision="no-params")
    assert f.verdict.value == "insufficient-evidence"
    assert f.evidence["missing_span"] == "kvobs.proxy.lookup"
    # ... but not when P shows the router forwarded params: the read decides.
    assert finding(decision="pull", read_outcome="done", remote_tokens=900,
                   read_duration_s=0.001, prompt_tokens=1000).verdict.value == "remote-hit"


def test_no_id_names_the_export_it_could_have_reused():
    f = finding(lookup="no-id", decision="no-params", extends_live=True,
                extends_ttl_left_s=20.0, **LINKED)
    assert f.verdict.value == "missing-metadata"
    assert "no conversation id" in f.remedy and "eng-A" in f.remedy


@pytest.mark.parametrize("row, words", [
    ({"lookup_miss_reason": "never-seen", "proxy_instance": "B", "prev_proxy_instance": "A",
      "proxy_started_at": 50.0, "prev_turn_end_ns": 40 * 10**9}, "proxy restarted"),
    ({"lookup_miss_reason": "never-seen", "proxy_instance": "B", "prev_proxy_instance": "A",
      "proxy_started_at": 10.0, "prev_turn_end_ns": 40 * 10**9}, "Another proxy replica"),
    ({"lookup_miss_reason": "not-stored", "prev_stream": True}, "never reached the proxy"),
    ({"lookup_miss_reason": "not-stored", "prev_stream": False}, "stored no params"),
    ({"lookup_miss_reason": "evicted"}, "entry cap evicted"),
])
def test_a_proxy_miss_names_why_the_proxy_had_no_entry(row, words):
    f = finding(lookup="miss", decision="no-params", **row)
    assert f.verdict.value == "missing-metadata"
    assert words in f.remedy
    assert "use the Redis backend" not in f.remedy


def test_a_stale_proxy_entry_while_d_still_held_the_blocks_blames_the_proxy_margin():
    f = finding(lookup="stale", decision="no-params", gap_s=14.0, prev_ttl_s=20.0,
                turn_start_ns=100 * 10**9, prev_export_expires_at=106.0)
    assert f.verdict.value == "expired"
    assert "proxy dropped its entry" in f.remedy and "6.0s" in f.remedy
    assert "--expiry-margin" in f.remedy
    # D's blocks really gone: the TTL remedy as before.
    gone = finding(lookup="stale", decision="no-params", gap_s=25.0, prev_ttl_s=20.0,
                   turn_start_ns=100 * 10**9, prev_export_expires_at=95.0)
    assert "outlived D's TTL" in gone.remedy


@pytest.mark.parametrize("read", ["failed", "declined-expired"])
def test_a_d_restart_is_transfer_failed_however_long_it_took(read):
    f = finding(lookup="hit", params_sent=True, decision="pull", read_outcome=read,
                extends_engine_restarted_at=130.0, extends_live=False, **LINKED)
    assert f.verdict.value == "transfer-failed"
    assert "D restarted" in f.remedy and "30.0s after the export" in f.remedy
    assert "check NIXL" not in f.remedy


def test_retokenization_at_the_boundary_is_told_from_a_rewritten_history():
    retok = finding(lookup="hit", params_sent=True, decision="prefix-mismatch",
                    prefix_matched_tokens=384, remote_tokens=399, read_outcome="done",
                    read_blocks=24)
    assert retok.verdict.value == "prefix-mismatch"
    assert "re-tokenize" in retok.remedy and "24 matching blocks" in retok.remedy
    assert "append-only" not in retok.remedy
    rewritten = finding(lookup="hit", params_sent=True, decision="prefix-mismatch",
                        prefix_matched_tokens=64, remote_tokens=399)
    assert "re-tokenize" in rewritten.remedy  # the proxy's text digest accepted it
    without_proxy = finding(lookup=None, decision="prefix-mismatch", prefix_matched_tokens=64,
                            remote_tokens=399, **LINKED)
    assert "append-only" in without_proxy.remedy


def test_a_declined_read_whose_export_span_was_lost_is_not_called_expired():
    """The proxy sent params, so D exported turn 1; with that export span lost the
    lineage cannot say whether D restarted since (transfer-failed) or not (expired)."""
    lost = finding(lookup="hit", params_sent=True, decision="pull",
                   read_outcome="declined-expired", gap_s=50.0)
    assert lost.verdict.value == "insufficient-evidence"
    assert lost.evidence["missing_span"] == "kvobs.decode.export"
    kept = finding(lookup="hit", params_sent=True, decision="pull",
                   read_outcome="declined-expired", gap_s=50.0, prev_export_tokens=400,
                   prev_ttl_s=40.0)
    assert kept.verdict.value == "expired"
