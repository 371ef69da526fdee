"""Scenario format: every shipped file parses; bad files give errors naming the field."""

import glob
import os

import pytest

from kvobs.testbed.scenario import ScenarioError, load, parse

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "scenarios", "*.toml"))))
def test_shipped_scenarios_parse(path):
    scenario = load(path)
    assert scenario.conversations


def test_demo_expects_every_producible_verdict():
    scenario = load(os.path.join(ROOT, "scenarios", "demo.toml"))
    assert set(scenario.expectations.values()) >= {
        "first-turn", "remote-hit", "below-threshold", "missing-metadata",
        "prefix-mismatch", "expired", "transfer-failed"}


MINIMAL = """
name = "x"
[[conversations]]
id = "a"
[[conversations.turns]]
"""


def test_defaults():
    scenario = parse(MINIMAL)
    (turn,) = scenario.conversations[0].turns
    assert (turn.append_tokens, turn.gap_s, turn.before) == (200, 0.0, ())
    assert scenario.engines.ttl_s == 30.0


@pytest.mark.parametrize("text, message", [
    (MINIMAL + "bogus = 1\n", r"conversations\[1\]\.turns\[1\]: unknown field\(s\) bogus"),
    (MINIMAL + 'expect = "fast"\n', r"expect: 'fast' is not a verdict"),
    (MINIMAL + 'before = "reboot"\n', r"before: 'reboot' not one of"),
    (MINIMAL + "gap_s = -1\n", r"gap_s >= 0"),
    (MINIMAL + 'expect_cause = "slow"\n', r"expect_cause: 'slow' is not one of"),
    (MINIMAL + 'expect_cause = ["queued-at-p", "slow"]\n', r"expect_cause: .* is not one of"),
    (MINIMAL + "expect_cause = []\n", r"expect_cause: \(\) is not one of"),
    (MINIMAL + "decode_load = -1\n", r"loads >= 0"),
    (MINIMAL + "stream = true\ndecode_load_at_first_token = true\n",
     r"turns\[1\]\.decode_load_at_first_token: needs decode_load"),
    (MINIMAL + "decode_load = 1\ndecode_load_at_first_token = true\n",
     r"turns\[1\]\.decode_load_at_first_token: a non-streamed turn"),
    ('name = "x"\n[engines]\nfailure_policy = "retry"\n' + MINIMAL.split('name = "x"')[1],
     r"engines\.failure_policy"),
    ('name = "x"\n[engines]\nrouter = "nginx"\n' + MINIMAL.split('name = "x"')[1],
     r"engines\.router: 'nginx' not one of"),
    ('name = "x"\n[engines]\nrouter = "vllm-router"\nproxy_fixed_lifetime_s = 450\n'
     + MINIMAL.split('name = "x"')[1], r"engines\.proxy_fixed_lifetime_s: a kvobs proxy"),
    (MINIMAL + 'before = ["crash-classifier"]\n',
     r"conversations\[1\]: crash-classifier needs engines\.live_classifier"),
    ('name = "x"\n', r"no conversations"),
    ("name = ", r"<scenario>:"),
])
def test_bad_scenarios_name_the_field(text, message):
    with pytest.raises(ScenarioError, match=message):
        parse(text)


def test_missing_file(tmp_path):
    with pytest.raises(ScenarioError, match="No such file"):
        load(str(tmp_path / "none.toml"))


def test_expected_causes_one_or_any_of_several():
    scenario = parse(MINIMAL + 'expect_cause = ["decode-busy", "queued-at-d"]\n')
    assert scenario.cause_expectations == {("a", 1): ("decode-busy", "queued-at-d")}
    assert parse(MINIMAL + 'expect_cause = "queued-at-p"\n').cause_expectations == {
        ("a", 1): "queued-at-p"}


def test_host_copy_makes_ds_connector_a_multiconnector_in_the_chosen_order():
    """engines.decode_host_copy_bytes: D's kv_transfer_config is vLLM's MultiConnector
    (its children valid vLLM KVTransferConfigs, as MultiConnector builds them), the host
    copy first unless decode_host_copy_first = false; P's stays the NIXL connector."""
    from vllm.config.kv_transfer import KVTransferConfig

    from kvobs.testbed.engines import PDPair

    scenario = parse(MINIMAL.replace('name = "x"', 'name = "x"\n[engines]\n'
                                     'decode_host_copy_bytes = 1048576'))
    settings = scenario.engines
    pair = PDPair("model", "out", kv_connector="KvobsNixlConnector",
                  kv_connector_module_path="connector_instrumented",
                  decode_host_copy_bytes=settings.decode_host_copy_bytes)
    assert pair.kv_config("prefill")["kv_connector"] == "KvobsNixlConnector"
    decode = pair.kv_config("decode")
    assert decode["kv_connector"] == "MultiConnector"
    children = decode["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["KvobsOffloadingConnector",
                                                     "KvobsNixlConnector"]
    assert children[0]["kv_connector_extra_config"]["cpu_bytes_to_use"] == 1048576
    assert children[1]["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    for child in children:
        KVTransferConfig(**child, engine_id="kvobs-decode")
    pair.decode_host_copy_first = False
    nixl_first = pair.kv_config("decode")["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in nixl_first] == ["KvobsNixlConnector",
                                                       "KvobsOffloadingConnector"]
    with pytest.raises(ScenarioError, match="decode_host_copy_bytes"):
        parse(MINIMAL.replace('name = "x"', 'name = "x"\n[engines]\n'
                              'decode_host_copy_bytes = -1'))


TWO = '''name = "x"
[[conversations]]
id = "a"
[[conversations.turns]]
max_tokens = 4
[[conversations]]
id = "b"
tenant = "t"
[[conversations.turns]]
max_tokens = 4
'''


def test_after_names_earlier_conversations_by_label_or_all_of_them():
    third = '[[conversations]]\nid = "c"\nafter = {}\n[[conversations.turns]]\n'
    assert parse(TWO + third.format('["t/b"]')).conversations[2].after == ("t/b",)
    assert parse(TWO + third.format('"*"')).conversations[2].after == ("a", "t/b")
    with pytest.raises(ScenarioError, match=r"conversations\[3\]\.after: \['b'\]"):
        parse(TWO + third.format('["b"]'))  # b's label is t/b
    with pytest.raises(ScenarioError, match=r"conversations\[3\]\.after: \['typo'\]"):
        parse(TWO + third.format('["*", "typo"]'))  # "*" does not hide a wrong label
    with pytest.raises(ScenarioError, match=r"conversations\[1\]\.after"):
        parse(TWO.replace('id = "a"\n', 'id = "a"\nafter = ["t/b"]\n'))  # not earlier


def _conversation(label_id, next_turn, due, turns=3):
    from kvobs.testbed.runner import _Conversation
    from kvobs.testbed.scenario import ConversationSpec, TurnSpec

    spec = ConversationSpec(label_id, tuple(TurnSpec() for _ in range(turns)))
    return _Conversation(spec, None, next_turn=next_turn, due=due)


def test_a_later_turn_due_before_a_first_turn_would_end_goes_first():
    from kvobs.testbed.runner import next_due_turn

    first = _conversation("new", 1, due=0.0)
    later = _conversation("old", 2, due=104.0)
    # a first turn sent at 100 would end at 110, after the later turn's due time
    assert next_due_turn([first, later], now=100.0, turn_estimate_s=10.0) == (later, 104.0)
    # the later turn is far off: the first turn goes now
    assert next_due_turn([first, later], now=100.0, turn_estimate_s=3.0) == (first, 0.0)
    # the first turn is not due yet: ask again when either could be
    first.due = 150.0
    assert next_due_turn([first, later], now=100.0, turn_estimate_s=3.0) == (None, 101.0)


def test_conversations_waiting_on_others_are_not_scheduled():
    from kvobs.testbed.runner import next_due_turn

    waiting = _conversation("waits", 1, due=None)
    done = _conversation("done", 4, due=5.0)
    with pytest.raises(RuntimeError, match="waits on another"):
        next_due_turn([waiting, done], now=0.0, turn_estimate_s=1.0)


def _together(label_id, next_turn, due, labels):
    from kvobs.testbed.runner import _Conversation
    from kvobs.testbed.scenario import ConversationSpec, TurnSpec

    spec = ConversationSpec(label_id, tuple(TurnSpec(together=t) for t in labels))
    return _Conversation(spec, None, next_turn=next_turn, due=due)


def test_turns_sent_together_wait_for_every_one_of_them():
    from kvobs.testbed.runner import together_ready, together_with

    a = _together("a", 2, 5.0, ["", "reads"])
    b = _together("b", 1, 0.0, ["", "reads"])  # its turn 1 first
    c = _together("c", 1, 0.0, ["", ""])
    everyone = [a, b, c]
    assert not together_ready(everyone, a) and together_ready(everyone, b)
    assert together_with(everyone, b) == [b]  # b's turn 1 goes alone
    b.next_turn, b.due = 2, 7.0
    assert together_ready(everyone, a) and together_ready(everyone, b)
    assert together_with(everyone, b) == [b, a]  # the picked one first
    assert together_with(everyone, c) == [c]
    b.next_turn = 3  # done: a's turn can no longer go with it
    assert not together_ready(everyone, a)


def test_together_labels_are_bounded():
    from kvobs.testbed.scenario import MAX_TOGETHER

    def scenario(members, turns='[[conversations.turns]]\ntogether = "x"\n'):
        return "name = \"x\"\n" + "".join(
            f'[[conversations]]\nid = "c{n}"\n{turns}' for n in range(members))

    assert [t.together for t in parse(scenario(2)).conversations[1].turns] == ["x"]
    with pytest.raises(ScenarioError, match="1 turns; 2 to"):
        parse(scenario(1))
    with pytest.raises(ScenarioError, match=f"{MAX_TOGETHER + 1} turns"):
        parse(scenario(MAX_TOGETHER + 1))
    with pytest.raises(ScenarioError, match="one turn per conversation"):
        parse(scenario(2, '[[conversations.turns]]\ntogether = "x"\n' * 2))


def test_a_first_token_load_may_follow_the_conversation_s_streaming():
    text = MINIMAL.replace('id = "a"', 'id = "a"\nstream = true')
    scenario = parse(text + "decode_load = 1\ndecode_load_at_first_token = true\n")
    assert scenario.conversations[0].turns[0].decode_load_at_first_token


def test_the_client_calls_back_on_a_streamed_answer_s_first_text():
    """The first-token trigger of a decode load: called once, when the first piece of
    text arrives, before the rest of the stream (a server that holds its second event
    until the callback ran)."""
    import http.server
    import threading

    from kvobs.testbed.runner import _send

    called = threading.Event()
    order = []

    class Streaming(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"text": ""}]}\n\n')
            self.wfile.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            self.wfile.flush()
            order.append(("callback seen before second event", called.wait(5)))
            self.wfile.write(b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Streaming)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    calls = []
    try:
        status, text, ttft, error, _ = _send(
            f"http://127.0.0.1:{server.server_port}/v1/completions", {}, True, 10,
            on_first_token=lambda: (calls.append(1), called.set()),
        )
    finally:
        thread.join(10)
        server.server_close()
    assert (status, text, error) == (200, "ab", None) and ttft is not None
    assert calls == [1] and order == [("callback seen before second event", True)]
