"""Several live classifiers behind the OpenTelemetry Collector's loadbalancing exporter
(``routing_key: attributes`` on ``kvobs.shard``), emulated: the Collector is a Go binary
that cannot be installed here (only the package registries are reachable), so each
OTLP export request is split by the key the exporter would route each span on, the
span's ``kvobs.shard``, or its trace id where it has none (the exporter itself sends
every trace whose first span lacks the attribute to one backend: the Kubernetes gateway,
components/sharded-classifiers, routes those spans by trace id in a pipeline of their
own), and each part goes to the classifier that key hashes to. Everything else is real: the
spans the real engines and proxy wrote, and ``kvobs.live.classifier.Classifier``."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from kvobs import semconv as sc
from kvobs.live.classifier import Classifier

NOW = 100.0  # the passes' clock: the recorded spans are all within its window


def routing_key(span: dict[str, Any]) -> str:
    for attribute in span.get("attributes") or ():
        if attribute.get("key") == sc.SHARD.key:
            return str(attribute.get("value", {}).get("stringValue"))
    return str(span.get("traceId"))


def split(request: dict, shards: int, key: Callable[[dict], str] = routing_key) -> list[dict]:
    """The export request as ``shards`` requests, each span in the one its key hashes to
    (resource and scope kept on every part)."""
    parts = [copy.deepcopy({**request, "resourceSpans": []}) for _ in range(shards)]
    for resource in request.get("resourceSpans") or ():
        shells = [{**resource, "scopeSpans": []} for _ in range(shards)]
        for scope in resource.get("scopeSpans") or ():
            kept: list[list] = [[] for _ in range(shards)]
            for span in scope.get("spans") or ():
                digest = hashlib.blake2b(key(span).encode(), digest_size=8).digest()
                kept[int.from_bytes(digest, "little") % shards].append(span)
            for shell, spans in zip(shells, kept):
                if spans:
                    shell["scopeSpans"].append({**scope, "spans": spans})
        for part, shell in zip(parts, shells):
            if shell["scopeSpans"]:
                part["resourceSpans"].append(shell)
    return parts


def requests_of(store: Path) -> list[dict]:
    """The run's OTLP export requests, as its components wrote them to the store."""
    return [
        json.loads(line)
        for path in sorted((store / sc.STORE_LIVE_DIR).glob("*" + ".otlp.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def final_turns(requests: list[dict], shards: int, key=routing_key) -> dict[tuple, dict]:
    """Every final turn of ``shards`` classifiers fed the split requests, by turn key;
    a key two classifiers both finalized is an error (a conversation split)."""
    classifiers = [Classifier(window_s=3600, grace_s=0) for _ in range(shards)]
    for request in requests:
        for classifier, part in zip(classifiers, split(request, shards, key)):
            if part["resourceSpans"]:
                classifier.add_request(part, now=NOW)
    turns: dict[tuple, dict] = {}
    for classifier in classifiers:
        for row in classifier.run_pass(now=NOW).finalized:
            key_ = (row["tenant"], row["conversation_id"], row["turn"])
            assert key_ not in turns, f"{key_} finalized by two classifiers"
            turns[key_] = row
    return turns


FIELDS = ("verdict", "rule", "evidence", "phases", "slowest_phase", "causes")


def differing_from_batch(turns: dict[tuple, dict], spans) -> list[tuple]:
    """The turns whose classification differs from the batch pipeline's over the whole
    run's ``spans`` (a span table) at the fleet context the turn recorded (each
    classifier measures its own: a shard's context is its turns'), and the batch's turns
    no classifier finalized."""
    from kvobs.diagnose import classify_turns
    from kvobs.turns import columns as col
    from kvobs.turns.correlate import turns_from_spans

    table = turns_from_spans(spans, frame=False)
    differing: list[tuple] = []
    for context in {json.dumps(t["context"], sort_keys=True) for t in turns.values()}:
        context = json.loads(context)
        diagnoses, _ = classify_turns(col.Columns(table), None,
                                      context["prefill_tokens_per_s"],
                                      context["decode_s_per_token"])
        batch = {(d.tenant, d.conversation_id, d.turn.index): d.to_dict() for d in diagnoses}
        differing += [key for key in set(batch) - set(turns)]
        for key, row in turns.items():
            if row["context"] == context and (
                key not in batch or any(row[f] != batch[key][f] for f in FIELDS)
            ):
                differing.append(key)
    return sorted(set(differing), key=str)


def spans_of(requests: list[dict]):
    """(name, attributes) of every span of the requests."""
    for request in requests:
        for resource in request.get("resourceSpans") or ():
            for scope in resource.get("scopeSpans") or ():
                for span in scope.get("spans") or ():
                    attributes = {
                        a.get("key"): next(iter((a.get("value") or {}).values()), None)
                        for a in span.get("attributes") or ()
                    }
                    yield span.get("name"), attributes


def shards_by_conversation(requests: list[dict]) -> tuple[dict[tuple, set], list[str]]:
    """Each conversation's (tenant, id) shards over its kvobs spans (the engines' and
    the proxy's: one each is right), and the kvobs spans of a conversation that carry
    none."""
    found: dict[tuple, set] = {}
    unkeyed: list[str] = []
    for name, attributes in spans_of(requests):
        conversation = attributes.get(sc.CONVERSATION_ID.key)
        if not name.startswith("kvobs.") or conversation is None:
            continue
        shard = attributes.get(sc.SHARD.key)
        if shard is None:
            unkeyed.append(f"{conversation}: {name}")
        else:
            key = (attributes.get(sc.TENANT_DIGEST.key), conversation)
            found.setdefault(key, set()).add(shard)
    return found, unkeyed
