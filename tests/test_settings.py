"""Every setting kvobs reasons with (D's TTL, P's recompute threshold, P's decline window,
the proxy's expiry margin and entry lifetime) has one name and one default, in
kvobs/settings.py: every surface takes its default from there, no code writes one out
again, and the docs state none differently."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from kvobs import semconv as sc
from kvobs import settings
from kvobs.settings import (DECLINE_WINDOW, DECODE_TTL, MIN_CACHED_TOKEN_DELTA,
                            PROXY_ENTRY_LIFETIME, PROXY_EXPIRY_MARGIN, RECOMPUTE_THRESHOLD,
                            SLOW_TRANSFER_FACTOR, UPSTREAM_ENTRY_LIFETIME)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = ("kvobs", "connector_instrumented")
DOCS = "docs"
# Generated from kvobs/settings.py and kept fresh by tests/packaging/test_docs.py.
GENERATED_DOCS = {"settings.md", "telemetry.md", "verdicts.md", "timeline.md", "turns.md"}

# What a line says to be about the setting (case-insensitive), and the values it must not
# write out as a default: the default itself, and defaults this setting once had
# elsewhere (the proxy lifetime as "TTL - 30 s", upstream's 450 s as a kvobs default).
NAMED = {
    DECODE_TTL: r"ttl",
    RECOMPUTE_THRESHOLD: r"recompute_threshold|(?<![\w.])threshold(?!\w)",
    DECLINE_WINDOW: r"declin",
    PROXY_EXPIRY_MARGIN: r"margin",
    PROXY_ENTRY_LIFETIME: r"lifetime|entry life",
    UPSTREAM_ENTRY_LIFETIME: r"upstream|fixed.entry.life|fixed_lifetime",
    MIN_CACHED_TOKEN_DELTA: r"min.?cached.?token.?delta",
    SLOW_TRANSFER_FACTOR: r"slow.?transfer.?factor",
}
RETIRED = {PROXY_EXPIRY_MARGIN: (30,), PROXY_ENTRY_LIFETIME: (450,)}


def _number(value: float) -> str:
    return rf"(?<![\w.]){re.escape(f'{value:g}')}(?:\.0+)?(?![\w.])"


def _as_default(value: float) -> re.Pattern:
    """The value given as a default: assigned (``= 480``, ``default=480``,
    ``"ttl": 480``) or stated (``default 480``, ``defaults to 480``, ``(default: 480)``)."""
    number = _number(value)
    return re.compile(rf"(?:[=:]\s*{number})|(?:default\w*\W{{1,3}}(?:of |is |to )?{number})",
                      re.IGNORECASE)


def _files(top: str, suffix: str):
    for directory, _, names in os.walk(os.path.join(ROOT, top)):
        for name in sorted(names):
            if name.endswith(suffix):
                path = os.path.join(directory, name)
                yield os.path.relpath(path, ROOT), path


def _lines(path: str):
    with open(path, encoding="utf-8") as handle:
        yield from enumerate(handle, 1)


def stray_defaults_in_code() -> list[str]:
    """Lines of kvobs/ and connector_instrumented/ that write out a setting's default
    (or a retired one) instead of importing it from kvobs/settings.py."""
    patterns = [(setting, re.compile(NAMED[setting], re.IGNORECASE),
                 [_as_default(v) for v in (setting.default, *RETIRED.get(setting, ()))])
                for setting in settings.SETTINGS]
    # The decline window is fixed, never "a default": its value in prose is the stray.
    within = re.compile(rf"within (?:a )?(?:fixed )?{_number(DECLINE_WINDOW.default)} ?s\b",
                        re.IGNORECASE)
    found = []
    for top in CODE:
        for relative, path in _files(top, ".py"):
            if relative == os.path.join("kvobs", "settings.py"):
                continue
            for number, line in _lines(path):
                for setting, named, values in patterns:
                    if named.search(line) and any(v.search(line) for v in values):
                        found.append(f"{relative}:{number}: {setting.name}: {line.strip()}")
                if within.search(line):
                    found.append(f"{relative}:{number}: {DECLINE_WINDOW.name}: {line.strip()}")
    return found


def misstated_defaults_in_docs() -> list[str]:
    """Lines of docs/ that state a default ("default 10 s", "defaults to 480") for a
    setting they name, other than one of the named settings' defaults; or the retired
    proxy lifetime "TTL - 30" on any line."""
    stated = re.compile(r"default\w*\W{1,3}(?:of |is |to )?`?(\d+(?:\.\d+)?)", re.IGNORECASE)
    retired = re.compile(r"(?:TTL|`S) ?- ?30\b")
    found = []
    for relative, path in _files(DOCS, ".md"):
        if os.path.basename(path) in GENERATED_DOCS:
            continue
        for number, line in _lines(path):
            named = [s for s in settings.SETTINGS if re.search(NAMED[s], line, re.IGNORECASE)]
            defaults = {float(s.default) for s in named}
            wrong = [v for v in stated.findall(line) if float(v) not in defaults]
            if (named and wrong) or retired.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_no_code_writes_out_a_settings_default():
    assert stray_defaults_in_code() == []


def test_no_doc_states_a_default_other_than_the_settings_one():
    assert misstated_defaults_in_docs() == []


@pytest.mark.parametrize("line, setting", [
    ('    expiry_margin_s: float = 10.0', PROXY_EXPIRY_MARGIN),
    ('@click.option("--decode-kv-ttl", type=float, default=480.0,', DECODE_TTL),
    ('    threshold: int = 64  # kv_recompute_threshold', RECOMPUTE_THRESHOLD),
    ('PROXY_MARGIN_S = 30.0  # proxy entry lifetime below D\'s TTL', PROXY_EXPIRY_MARGIN),
    ('    proxy_entry_lifetime_seconds: float = 450.0', PROXY_ENTRY_LIFETIME),
    ('"more: its entry ends --expiry-margin seconds (default 10) before D\'s "',
     PROXY_EXPIRY_MARGIN),
    ('@click.option("--min-cached-token-delta", type=int, default=2048)',
     MIN_CACHED_TOKEN_DELTA),
    ('    slow_transfer_factor: float = 2.0', SLOW_TRANSFER_FACTOR),
])
def test_the_check_finds_the_strays_it_removed(line, setting, tmp_path, monkeypatch):
    """The lines this check replaced (kvobs before kvobs/settings.py) are what it finds."""
    (tmp_path / "kvobs").mkdir()
    (tmp_path / "kvobs" / "stray.py").write_text(line + "\n")
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    found = stray_defaults_in_code()
    assert [f for f in found if f": {setting.name}: " in f], found


def test_the_doc_check_finds_a_misstated_default(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text(
        "The proxy's entry lifetime is set 30 s below the TTL (as the defaults 450/480 s).\n"
        "`--expiry-margin` >= 5 s (default 10 s); keep it below `decoder_kv_blocks_ttl`.\n"
        "expired if the gap reaches `S - 5` or `L` (default `S - 30`)\n")
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    found = misstated_defaults_in_docs()
    assert [line.split(":")[1] for line in found] == ["1", "3"], found


def test_every_surface_takes_its_default_from_settings():
    from kvobs.proxy.config import ProxyConfig
    from kvobs.cli.proxy import proxy_command
    from kvobs.monitoring.config import DEFAULT as MONITORING
    from kvobs.synth import SyntheticConfig
    from kvobs.testbed.engines import PDPair, kv_transfer_config
    from kvobs.testbed.scenario import EngineSettings

    options = {o.name: o.default for o in proxy_command.params}
    assert options["decode_kv_ttl"] == DECODE_TTL.default
    assert options["expiry_margin"] == PROXY_EXPIRY_MARGIN.default
    fields = {f.name: f.default for f in dataclasses.fields(ProxyConfig)}
    assert fields["decode_kv_ttl_s"] == DECODE_TTL.default
    assert fields["expiry_margin_s"] == PROXY_EXPIRY_MARGIN.default
    assert MONITORING.decode_ttl_seconds == DECODE_TTL.default
    assert MONITORING.entry_lifetime_seconds == PROXY_ENTRY_LIFETIME.default
    synthetic = SyntheticConfig()
    assert (synthetic.ttl_s, synthetic.threshold, synthetic.proxy_lifetime_s) == (
        DECODE_TTL.default, RECOMPUTE_THRESHOLD.default, UPSTREAM_ENTRY_LIFETIME.default)
    pair = {f.name: f.default for f in dataclasses.fields(PDPair)}
    assert pair["decoder_kv_blocks_ttl"] == DECODE_TTL.default
    assert pair["kv_recompute_threshold"] == RECOMPUTE_THRESHOLD.default
    extra = kv_transfer_config()["kv_connector_extra_config"]
    assert extra["decoder_kv_blocks_ttl"] == DECODE_TTL.default
    assert extra["kv_recompute_threshold"] == RECOMPUTE_THRESHOLD.default
    assert {f.name: f.default for f in dataclasses.fields(EngineSettings)}["threshold"] == \
        RECOMPUTE_THRESHOLD.default


def test_the_derived_defaults_hold_together():
    assert PROXY_ENTRY_LIFETIME.default == settings.entry_lifetime_s(DECODE_TTL.default)
    # The proxy's margin covers P's decline window, and its entries end before D's TTL.
    assert PROXY_EXPIRY_MARGIN.default >= DECLINE_WINDOW.default
    assert UPSTREAM_ENTRY_LIFETIME.default < PROXY_ENTRY_LIFETIME.default < DECODE_TTL.default
    assert settings.read_declined(DECODE_TTL.default - DECLINE_WINDOW.default,
                                  DECODE_TTL.default)
    assert not settings.read_declined(PROXY_ENTRY_LIFETIME.default, DECODE_TTL.default)


def test_the_default_lifetimes_are_bucket_bounds():
    """Gap and TTL histograms split exactly at the default lifetimes (bounds are written
    out in kvobs/semconv.py: a metric contract)."""
    for lifetime in (DECODE_TTL, UPSTREAM_ENTRY_LIFETIME):
        assert lifetime.default in sc.GAP_BUCKETS
    assert DECODE_TTL.default in sc.TTL_BUCKETS
