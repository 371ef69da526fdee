"""The synthetic fleet's spans with the prefix chains real engines put on them.

``kvobs.synth`` simulates the proxy's and the engines' spans without the connector's
block-hash digests, so a classifier fed those never runs its lineage stage, which every
deployment of the instrumented connector runs on every turn. ``with_prefix_chains`` adds
what the connector adds: P's decision spans carry the digest of their prompt, D's export
the digest of prompt + output (``connector_instrumented._digest.encode``, block 16) and
the P request it served (``remote_request_id``). Each conversation's turns extend one list
of block hashes, so a turn's prompt extends the previous turn's export; a turn P found
rewritten (``prefix-mismatch``) keeps the first half of the blocks and continues with new
ones. Used by the benchmarks' ``--chains``; kept in bench/ so that every tree a benchmark
compares builds the same spans.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pyarrow as pa

from connector_instrumented._digest import encode
from kvobs import semconv as sc

BLOCK = 16
SEED = "synth000"


def with_prefix_chains(table: pa.Table, seed: int = 1) -> pa.Table:
    columns = {
        name: table.column(name).to_pylist()
        for name in (
            "name",
            "trace_id",
            sc.CONVERSATION_ID.key,
            sc.TURN_INDEX.key,
            sc.PROMPT_TOKENS.key,
            sc.EXPORT_TOKENS.key,
            sc.PULL_DECISION.key,
            sc.REQUEST_ID.key,
        )
    }
    names = columns["name"]
    decision, export = sc.SPAN_PULL_DECISION.name, sc.SPAN_EXPORT.name
    turns: dict[str, dict[int, dict]] = defaultdict(dict)
    for i, name in enumerate(names):
        if name not in (decision, export):
            continue
        turn = turns[columns[sc.CONVERSATION_ID.key][i]].setdefault(
            columns[sc.TURN_INDEX.key][i], {}
        )
        if name == export:
            turn["export_tokens"] = columns[sc.EXPORT_TOKENS.key][i]
        elif not turn.get("p_request"):  # the first decision: a fallback retries it
            turn["p_request"] = columns[sc.REQUEST_ID.key][i]
            turn["prompt_tokens"] = columns[sc.PROMPT_TOKENS.key][i]
            turn["rewritten"] = columns[sc.PULL_DECISION.key][i] == (
                sc.PullDecision.PREFIX_MISMATCH.value
            )
    rng = random.Random(seed)
    for conversation in turns.values():
        hashes: list[bytes] = []
        for number in sorted(conversation):
            turn = conversation[number]
            if turn.get("rewritten"):
                del hashes[len(hashes) // 2 :]
            for key in ("prompt_tokens", "export_tokens"):
                tokens = turn.get(key) or 0
                while len(hashes) < tokens // BLOCK:
                    hashes.append(rng.randbytes(32))
                turn[key + "_chain"] = encode(hashes, tokens, BLOCK, SEED) if tokens else None
    chains, remote = [], []
    for i, name in enumerate(names):
        turn = turns.get(columns[sc.CONVERSATION_ID.key][i], {}).get(
            columns[sc.TURN_INDEX.key][i], {}
        )
        if name == decision:
            chains.append(turn.get("prompt_tokens_chain"))
            remote.append(None)
        elif name == export:
            chains.append(turn.get("export_tokens_chain"))
            remote.append(turn.get("p_request"))
        else:
            chains.append(None)
            remote.append(None)
    for key, values in ((sc.PREFIX_LINEAGE.key, chains), (sc.REMOTE_REQUEST_ID.key, remote)):
        field = table.schema.field(key)
        table = table.set_column(
            table.schema.get_field_index(key), field, pa.array(values, field.type)
        )
    return table
