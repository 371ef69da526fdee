import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvobs import synth  # noqa: E402

CONFIG = synth.small(250, seed=3)


@pytest.fixture(scope="session")
def synthetic_config():
    return CONFIG


@pytest.fixture(scope="session")
def synthetic_store(tmp_path_factory):
    """A small synthetic store with every scenario; written through ``write_store``."""
    path = tmp_path_factory.mktemp("synthetic-store")
    result = synth.write_store(str(path), CONFIG)
    return str(path), result
