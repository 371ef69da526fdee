"""Wall time of whole ``kvobs`` CLI processes, as a user meets them, against interpreter
baselines measured in the same run.

    python bench/startup_bench.py --dir /tmp/kvobs-bench [--conversations 1000000] [--repeat 15]
        [--also-rev REV] [--store DIR]

Each process runs under ``/usr/bin/time`` (elapsed, user and system seconds); the
commands run round-robin so that the box's load falls on all of them alike. Commands:
``python -c pass`` and ``python -c "import pandas"`` (baselines), ``kvobs --help``, and
``kvobs diagnose ID --json`` for one conversation (a different one each round) of the
synthetic store that bench/diagnose_bench.py builds (``kvobs.synth``, generated once
under ``--dir`` and reused), or with ``--store DIR`` of an existing store: a compacted
testbed run, whose real engine spans carry prefix chains, so diagnose links them (the
synthetic spans carry none); its conversation ids that one tenant uses (diagnose needs
``--tenant`` for the others). ``--also-rev REV`` adds both kvobs commands run from
kvobs/ as it was at a git revision (a change's before, in the same run). Prints medians
and the margin over each baseline. Target: ``diagnose --json`` under 0.5 s wall (aim
0.25 s); printed, never asserted.
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _synthetic_store import bench_store  # noqa: E402

from kvobs import synth  # noqa: E402
from kvobs.sources import open_source  # noqa: E402

TARGET_S, AIM_S = 0.5, 0.25
TIME = "/usr/bin/time"
# An installed kvobs loads its modules from .pyc files; with PYTHONDONTWRITEBYTECODE set
# (as on some CI images) every run would compile kvobs's sources again (~0.1 s). The
# processes run with caching on: the warm-up run writes the .pyc files.
ENV = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVOBS = os.path.join(os.path.dirname(sys.executable), "kvobs")


def kvobs_at(rev: str, work: str) -> str:
    """A directory holding kvobs/ as it was at ``rev``, to put first on PYTHONPATH."""
    target = os.path.join(work, f"kvobs-{rev.replace('/', '_')}")
    os.makedirs(target, exist_ok=True)
    subprocess.run(f"git -C {shlex.quote(ROOT)} archive {shlex.quote(rev)} kvobs "
                   f"| tar -x -C {shlex.quote(target)}", shell=True, check=True)
    return target


def single_tenant_ids(store: str) -> list[str]:
    """The store's conversation ids that one tenant uses: diagnose takes them alone."""
    rows = pa.concat_tables(open_source(store).turn_row_slices())
    pairs = set(zip(rows.column("conversation_id").to_pylist(),
                    rows.column("tenant").to_pylist()))
    tenants = collections.Counter(cid for cid, _ in pairs)
    return sorted(cid for cid, count in tenants.items() if count == 1)


def timed(command: list[str], env: dict | None = None) -> tuple[float, float, int]:
    """(elapsed s, user + system s, exit status) of one process, by /usr/bin/time."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        done = subprocess.run([TIME, "-o", report.name, "-f", "%e %U %S", *command],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=env or ENV)
        elapsed, user, system = map(float, report.read().split()[-3:])
    if done.returncode not in (0, 1, 3):  # a verdict's exit status is not a failure
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}: {done.stderr}")
    return elapsed, user + system, done.returncode


def timing_arguments(doc: str, repeat: int) -> argparse.ArgumentParser:
    """The arguments of a CLI timing bench (``--dir``, ``--repeat``, ``--also-rev``);
    exits when /usr/bin/time is missing."""
    if not os.access(TIME, os.X_OK):
        raise SystemExit(f"{TIME} is needed (Debian: apt-get install time)")
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/kvobs-bench")
    parser.add_argument("--repeat", type=int, default=repeat, choices=range(1, 1000),
                        metavar="N")
    parser.add_argument("--also-rev", help="also run the kvobs commands from kvobs/ at this "
                        "git revision (a change's before, in the same run)")
    return parser


def with_baselines(kvobs_commands: dict[str, list[str]], rev: str | None, work: str
                   ) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """(commands, their environments): the interpreter baselines, ``kvobs_commands``,
    and with ``rev`` each of those again from kvobs/ at that revision."""
    commands = {"python -c pass": [sys.executable, "-c", "pass"],
                "python -c 'import pandas'": [sys.executable, "-c", "import pandas"],
                **kvobs_commands}
    envs = {name: ENV for name in commands}
    if rev:
        before = {**ENV, "PYTHONPATH": kvobs_at(rev, work)}
        for name in kvobs_commands:
            commands[f"{name} @{rev}"] = commands[name]
            envs[f"{name} @{rev}"] = before
    return commands, envs


def round_robin(commands: dict[str, list[str]], envs: dict[str, dict], picks: list[str],
                repeat: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall s, CPU s) of ``repeat`` runs of each command (its word ``ID``: run i's pick),
    run round-robin after one uncounted run each (page cache, .pyc files)."""
    def run(name: str, i: int) -> tuple[float, float, int]:
        return timed([picks[i] if word == "ID" else word for word in commands[name]],
                     envs[name])

    for name in commands:
        run(name, 0)
    wall: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    for i in range(repeat):
        for name in commands:
            elapsed, seconds, _ = run(name, i)
            wall[name].append(elapsed)
            cpu[name].append(seconds)
    return wall, cpu


def print_medians(what: str, wall: dict[str, list[float]], cpu: dict[str, list[float]]
                  ) -> None:
    load = os.getloadavg()[0]
    print(f"{what}, round-robin, /usr/bin/time; load average {load:.1f} "
          f"on {os.cpu_count()} CPUs at the end")
    width = max(map(len, wall))
    print(f"{'command':{width}} {'wall median':>11} {'wall min':>9} {'cpu median':>11}")
    for name in wall:
        print(f"{name:{width}} {statistics.median(wall[name]):10.3f}s {min(wall[name]):8.3f}s "
              f"{statistics.median(cpu[name]):10.3f}s")


def main() -> None:
    parser = timing_arguments(__doc__, repeat=15)
    parser.add_argument("--conversations", type=int, default=1_000_000)
    parser.add_argument("--store", help="diagnose conversations of this existing store "
                        "instead of the synthetic one")
    args = parser.parse_args()
    if args.store:
        store, ids = args.store, single_tenant_ids(args.store)
        print(f"store {store}: {len(ids)} conversation ids")
    else:
        store, config = bench_store(args.dir, args.conversations)
        ids = synth.conversation_ids(config)
    picks = [ids[(i * 7919 * 104729) % len(ids)] for i in range(args.repeat)]
    commands, envs = with_baselines({
        "kvobs --help": [KVOBS, "--help"],
        "kvobs diagnose ID --json": [KVOBS, "diagnose", "ID", "--source", store, "--json"],
    }, args.also_rev, args.dir)

    wall, cpu = round_robin(commands, envs, picks, args.repeat)
    print_medians(f"{args.repeat} runs each", wall, cpu)
    median = {name: statistics.median(values) for name, values in wall.items()}
    diagnose, pandas = median["kvobs diagnose ID --json"], median["python -c 'import pandas'"]
    print(f"diagnose --json over `import pandas`: +{diagnose - pandas:.3f}s "
          f"({diagnose / pandas:.2f}x); --help over `pass`: "
          f"+{median['kvobs --help'] - median['python -c pass']:.3f}s")
    verdict = "PASS" if diagnose < TARGET_S else "FAIL"
    aim = "met" if diagnose < AIM_S else "not met"
    print(f"target diagnose --json < {TARGET_S} s wall (median): {verdict}; "
          f"aim {AIM_S} s: {aim}")


if __name__ == "__main__":
    main()
