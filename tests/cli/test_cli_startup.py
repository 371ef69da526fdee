"""Start-up: each command imports what it uses, so `kvobs --help` and `kvobs diagnose
--json` do not pay for pandas, rich, aiohttp or OpenTelemetry when they do not need them
(bench/startup_bench.py measures the seconds; these tests check what is imported)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys

import click
import pytest

from kvobs.cli import COMMANDS, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_SPANS = os.path.join(ROOT, "tests", "data", "demo-spans.otlp.jsonl")
HEAVY = ("pandas", "pyarrow", "numpy", "rich", "aiohttp", "opentelemetry")
# Prints the top-level packages a kvobs command imported (its exit status after them).
_PROBE = """
import sys
from kvobs.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    status = done.code
sys.stdout = sys.__stdout__
print("\\nimported:", " ".join(sorted({m.split('.')[0] for m in sys.modules})), status)
"""


def _imported(*args: str) -> tuple[set[str], str, object]:
    done = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          timeout=120)
    output, _, last = done.stdout.rpartition("\nimported: ")
    *modules, status = last.split()
    return set(modules), output, status


def _packages(modules: set[str]) -> set[str]:
    return {module.split(".")[0] for module in modules}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_summary_is_the_first_sentence_of_the_commands_help(name):
    target, summary = COMMANDS[name]
    module, attribute = target.split(":")
    command = getattr(importlib.import_module(module), attribute)
    assert summary == command.get_short_help_str(limit=10**6)


def test_help_lists_every_command_importing_none_of_them():
    modules, output, status = _imported("--help")
    assert status == "0"
    assert [line.split()[0] for line in output.split("Commands:\n")[1].splitlines()
            if line.strip()] == sorted(COMMANDS)
    assert _packages(modules).isdisjoint(HEAVY), _packages(modules) & set(HEAVY)
    commands = {target.split(":")[0] for target, _ in COMMANDS.values()}
    assert modules.isdisjoint(commands), modules & commands


def test_help_text_is_what_click_writes_from_the_commands_themselves():
    class Eager(click.Group):
        def list_commands(self, ctx):
            return sorted(COMMANDS)

        def get_command(self, ctx, name):
            return main.get_command(ctx, name)

    eager = Eager(name="kvobs", help=main.help, params=main.params,
                  context_settings=main.context_settings)
    with click.Context(eager, info_name="kvobs", **main.context_settings) as ctx:
        expected = eager.get_help(ctx)
    with click.Context(main, info_name="kvobs", **main.context_settings) as ctx:
        assert main.get_help(ctx) == expected


def test_diagnose_json_imports_no_terminal_or_serving_stack():
    modules, output, status = _imported("diagnose", "agent-happy", "--source", DEMO_SPANS,
                                        "--json")
    assert status == "0"
    assert [t["verdict"] for t in json.loads(output)["turns"]] == [
        "first-turn", "remote-hit", "remote-hit"]
    assert _packages(modules).isdisjoint({"rich", "aiohttp", "opentelemetry"})


def test_diagnose_json_of_a_store_loads_no_pandas(tmp_path):
    """One conversation of a compacted store is read, linked by its prefix chains
    (kvobs.turns.lineage: real engines' spans all carry them), correlated, classified and
    printed without pandas (pyarrow imports it on a numpy conversion: kvobs.turns.arrays avoids
    them; pyarrow.dataset imports it too: the store reads one conversation by
    pyarrow.parquet)."""
    from kvobs import semconv as sc
    from kvobs.sources.store import compact

    with open(DEMO_SPANS) as spans:
        assert spans.read().count(f'"{sc.PREFIX_LINEAGE.key}"') > 10
    os.makedirs(tmp_path / "spans")
    shutil.copy(DEMO_SPANS, tmp_path / "spans" / "seg.jsonl")
    compact(str(tmp_path), writers_stopped=True)
    for conversation, verdicts, exit_status in (
            ("agent-happy", ["first-turn", "remote-hit", "remote-hit"], "0"),
            ("agent-d-restart", ["first-turn", "transfer-failed"], "1")):  # 1: a fault
        modules, output, status = _imported("diagnose", conversation, "--source",
                                            str(tmp_path), "--json")
        turns = json.loads(output)["turns"]
        assert (status, [t["verdict"] for t in turns]) == (exit_status, verdicts)
        assert "pandas" not in _packages(modules)
    # The restart is a lineage fact: the export turn 2 extends, and the engine after it.
    assert turns[1]["evidence"]["extends_engine_restarted_at"] is not None


@pytest.mark.parametrize("source", ["span file", "live store", "compacted and live"])
def test_diagnose_json_of_span_files_loads_no_pandas(tmp_path, source):
    """Span files are read into the Arrow span table without pandas: a span file, a store
    whose writers are running (live segments only), and one with live segments next to
    compacted ones (a span in both read once); the demo spans, prefix chains included."""
    from kvobs.sources.store import compact

    os.makedirs(tmp_path / "spans")
    segment = tmp_path / "spans" / "seg.jsonl"
    shutil.copy(DEMO_SPANS, segment)
    if source == "compacted and live":
        compact(str(tmp_path), writers_stopped=True)
        shutil.copy(DEMO_SPANS, segment)
    modules, output, status = _imported("diagnose", "agent-happy", "--source",
                                        str(segment if source == "span file" else tmp_path),
                                        "--json")
    assert status == "0"
    assert [t["verdict"] for t in json.loads(output)["turns"]] == [
        "first-turn", "remote-hit", "remote-hit"]
    assert "pandas" not in _packages(modules)


def test_diagnose_json_of_chdb_loads_no_pandas(tmp_path):
    """ClickHouse (embedded: chdb) answers in Arrow and the span table stays Arrow; chdb's
    own Arrow table output imports pandas, so the client reads the Arrow stream itself.
    (chdb serves one database directory per process: loaded in a process of its own.)"""
    pytest.importorskip("chdb")
    from kvobs.sources.store import compact

    store = tmp_path / "store"
    os.makedirs(store / "spans")
    shutil.copy(DEMO_SPANS, store / "spans" / "seg.jsonl")
    compact(str(store), writers_stopped=True)
    os.makedirs(tmp_path / "chdb")
    subprocess.run([sys.executable, "-c", "import sys\n"
                    "from kvobs.sources.clickhouse import ClickHouseSource\n"
                    "source = ClickHouseSource.chdb(sys.argv[1])\n"
                    "source.create_table()\nsource.load_store(sys.argv[2])",
                    str(tmp_path / "chdb"), str(store)],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    modules, output, status = _imported("diagnose", "agent-happy", "--source",
                                        f"chdb:{tmp_path / 'chdb'}", "--json")
    assert status == "0"
    assert [t["verdict"] for t in json.loads(output)["turns"]] == [
        "first-turn", "remote-hit", "remote-hit"]
    assert "pandas" not in _packages(modules)


# Runs kvobs as its own process does (``main()`` without arguments: the console script,
# ``python -m kvobs``); prints "atexit" from an atexit handler and "teardown" from an
# object freed only by Python's teardown at exit.
_AS_THE_PROCESS = """
import atexit, os, sys
class Teardown:
    def __del__(self, write=os.write):
        write(2, b"teardown\\n")
probe = Teardown()
atexit.register(os.write, 2, b"atexit\\n")
sys.argv = ["kvobs", *sys.argv[1:]]
from kvobs.cli import main
main()
"""


def _as_the_process(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _AS_THE_PROCESS, *args], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **env},
                          timeout=120)


def test_diagnose_of_files_exits_without_teardown_and_the_same_output(tmp_path):
    """`kvobs diagnose` of span files or a store, as its own process, exits once its
    output is flushed and the atexit handlers ran, without Python's teardown of numpy and
    pyarrow (~30 ms); its output and exit status are the normal exit's (KVOBS_DEBUG keeps
    that one). A command that did not allow it (an input error here) tears down."""
    from kvobs.sources.store import compact

    os.makedirs(tmp_path / "spans")
    shutil.copy(DEMO_SPANS, tmp_path / "spans" / "seg.jsonl")
    compact(str(tmp_path), writers_stopped=True)
    for source in (DEMO_SPANS, str(tmp_path)):
        for conversation, verdicts, exit_status in (
                ("agent-happy", ["first-turn", "remote-hit", "remote-hit"], 0),
                ("agent-d-restart", ["first-turn", "transfer-failed"], 1)):
            args = ("diagnose", conversation, "--source", source, "--json")
            quick, normal = _as_the_process(*args), _as_the_process(*args, KVOBS_DEBUG="1")
            assert [t["verdict"] for t in json.loads(quick.stdout)["turns"]] == verdicts
            assert (quick.stdout, quick.returncode) == (normal.stdout, normal.returncode)
            assert quick.returncode == exit_status
            assert quick.stderr.split() == ["atexit"], quick.stderr
            assert normal.stderr.split() == ["atexit", "teardown"], normal.stderr
    unknown = _as_the_process("diagnose", "no-such-id", "--source", DEMO_SPANS, "--json")
    assert unknown.returncode == 2
    assert unknown.stderr.split()[-2:] == ["atexit", "teardown"], unknown.stderr


def test_commands_load_numpy_with_one_blas_thread_unless_the_user_chose(tmp_path):
    """A command's module is imported with OPENBLAS_NUM_THREADS=1 (OpenBLAS reads it when
    numpy loads: no command does linear algebra, and its thread pool spins ~0.1 CPU-s at
    start); the environment is restored after, and a user's value is kept."""
    (tmp_path / "blas_seen.py").write_text(
        "import os\nSEEN = os.environ.get('OPENBLAS_NUM_THREADS')\n")
    probe = ("import os, sys\nfrom kvobs.cli import _import_command\n"
             "seen = _import_command('blas_seen').SEEN\n"
             "print(seen, os.environ.get('OPENBLAS_NUM_THREADS'), 'numpy' in sys.modules)")
    env = {key: value for key, value in os.environ.items() if key != "OPENBLAS_NUM_THREADS"}
    for user, expected in ((None, "1 None False"), ("4", "4 4 False")):
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
            env={**env, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)]),
                 **({"OPENBLAS_NUM_THREADS": user} if user else {})}, timeout=120)
        assert done.stdout.split() == expected.split(), done.stderr
