import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fleet_cases import CONFIG, FACTORY_CASES, SHARED_ID, TENANTS  # noqa: E402
from spanfactory import Tracers, write_conversation  # noqa: E402

from kvobs import synth  # noqa: E402


@pytest.fixture(scope="session")
def synthetic_config():
    return CONFIG


@pytest.fixture(scope="session")
def synthetic_store(tmp_path_factory):
    """A small synthetic store with every scenario; written through ``write_store``."""
    path = tmp_path_factory.mktemp("synthetic-store")
    result = synth.write_store(str(path), CONFIG)
    return str(path), result


@pytest.fixture(scope="session")
def factory_store(tmp_path_factory):
    """Live spans through the real emit path: every case, and two tenants sharing an id
    (their turns interleaved in time)."""
    path = tmp_path_factory.mktemp("factory")
    tracers = Tracers(str(path))
    for name, specs in FACTORY_CASES.items():
        write_conversation(tracers, name, specs)
    for offset, (tenant, specs) in enumerate(TENANTS.items()):
        write_conversation(tracers, SHARED_ID, specs, 1_700_000_000.0 + 3 * offset, tenant)
    return str(path)
