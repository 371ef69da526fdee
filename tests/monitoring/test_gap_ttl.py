"""The "gaps longer than D's TTL" share, evaluated by promtool for TTLs on and off the
gap histogram's bucket bounds.

The histogram's bounds are fixed (``semconv.GAP_BUCKETS``) while the TTL is the
deployment's, read when the query runs from the TTL the proxy reports
(``kvobs_proxy_decode_ttl_seconds``): the share must be right whether or not the TTL is a
bound (it once read the bucket ``le="<ttl>"``, which does not exist for TTL 300, and
showed 100 %). Each case feeds gaps whose true share above the TTL is known and spreads
them evenly inside their buckets, where the interpolation is exact, next to the proxy's
TTL gauge; the rule itself is the same for every TTL.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace

import pytest
import yaml

from kvobs.monitoring import queries, rules
from kvobs.monitoring.config import DEFAULT
from kvobs.semconv import GAP_BUCKETS, M_PROXY_DECODE_TTL, M_PROXY_GAP

PROXY = rules.PROXY


def _even(lo: float, hi: float, n: int = 60) -> dict[float, float]:
    """``n`` gaps a minute spread evenly over ``(lo, hi]``."""
    step = (hi - lo) / n
    return {lo + step * (i + 1): 1 for i in range(n)}


CASES = [
    # (TTL, gaps per minute {value: count}, expected share, what it shows)
    (300, {30: 20, 120: 20, 240: 20}, 0.0, "TTL not a bound, every gap below it"),
    (300, _even(240, 360), 0.5, "TTL not a bound, half the gaps above it"),
    (90, _even(60, 120), 0.5, "another TTL between two bounds"),
    (480, {470: 30, 600: 30}, 0.5, "TTL on a bound: exact"),
    (0.5, _even(0, 1), 0.5, "TTL below the first bound"),
]


def _truth(gaps: dict[float, float], ttl: float) -> float:
    return sum(n for v, n in gaps.items() if v > ttl) / sum(gaps.values())


def _record(config=DEFAULT):
    name = rules.record_name("kvobs_proxy_inter_turn_gap_over_decode_ttl",
                             f"ratio_rate{config.windows.rate}", config)
    (rec,) = [r for r in rules.recordings(config) if r.record == name]
    return rec


def _promtool_eval(promtool: str, tmp_path, expr: str, gaps: dict[float, float],
                   expected: float, ttl: float) -> subprocess.CompletedProcess:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(
        {"groups": [{"name": "g", "rules": [{"record": "gap_share", "expr": expr}]}]}))
    labels = rules._text(rules._kept(PROXY, DEFAULT))
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": rules._series_list({
            **rules.histogram_series(M_PROXY_GAP, PROXY, gaps),
            rules.sel(M_PROXY_DECODE_TTL, PROXY): f"{ttl:g}x40"}),
        "promql_expr_test": [{"expr": "gap_share", "eval_time": "10m",
                              "exp_samples": [{"labels": f"gap_share{labels}",
                                               "value": expected}]}]}]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    return subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ttl, gaps, expected, what", CASES, ids=[c[3] for c in CASES])
def test_share_of_gaps_above_the_ttl(promtool, tmp_path, ttl, gaps, expected, what):
    assert _truth(gaps, ttl) == expected  # the case is what it says
    result = _promtool_eval(promtool, tmp_path, _record().expr, gaps, expected, ttl)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rule_does_not_depend_on_the_configured_ttl():
    """One rule for every TTL: the configured one changes nothing in it."""
    other = replace(DEFAULT, decode_ttl_seconds=300)
    assert _record(other).expr == _record().expr
    assert M_PROXY_DECODE_TTL.name in _record().expr


def test_a_wrong_expectation_fails(promtool, tmp_path):
    """The promtool evaluation above can fail: the every-gap-below case against 1."""
    result = _promtool_eval(promtool, tmp_path, _record().expr, {30: 60}, 1.0, 300)
    assert result.returncode != 0
    # and the TTL the proxy reports is what counts: the same gaps, a TTL below them
    result = _promtool_eval(promtool, tmp_path, _record().expr, {30: 60}, 0.0, 15)
    assert result.returncode != 0


def test_at_least_three_ttls_off_and_on_bounds():
    ttls = {ttl for ttl, *_ in CASES}
    assert len(ttls) >= 3
    assert any(t in GAP_BUCKETS for t in ttls) and any(t not in GAP_BUCKETS for t in ttls)


def test_ttl_beyond_the_last_bound_says_it_is_an_upper_bound(promtool, tmp_path):
    """Past the last bound the histogram cannot tell: the share above the last bound is
    shown (an upper bound), and the legend says so."""
    ttl = 5000.0
    assert ttl > max(GAP_BUCKETS)
    gaps = {4000: 60}  # all below the TTL, all above the last bound
    result = _promtool_eval(promtool, tmp_path, _record().expr, gaps, 1.0, ttl)
    assert result.returncode == 0, result.stdout + result.stderr


def test_panels_read_the_reported_ttl_and_say_how(sdk):
    from kvobs.monitoring import dashboards

    board = dashboards.build_overview(DEFAULT)
    for title in ("Gaps longer than D's TTL", "Gaps beyond D's TTL"):
        (panel,) = [p for p in board["panels"] if p.get("title") == title]
        assert panel["targets"][0]["expr"] == queries.gap_over_ttl_ratio(
            queries.Scope(*_dashboard_scope()))
        assert "interpolated linearly" in panel["description"]
        assert "upper bound" in panel["description"]
        assert f"`{M_PROXY_DECODE_TTL.name}`" in panel["description"].split("Metrics:")[-1]


def _dashboard_scope():
    from kvobs.monitoring.config import DASHBOARD_SELECTORS
    from kvobs.monitoring.dashboards import RATE_INTERVAL

    return DASHBOARD_SELECTORS.engine, DASHBOARD_SELECTORS.proxy, RATE_INTERVAL
