import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fleet_cases import CONFIG, FACTORY_CASES, SHARED_ID, TENANTS, chdb_table  # noqa: E402
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


# ClickHouse on chdb (tests/fleet/test_clickhouse*.py; chdb_path: tests/conftest.py):
# each span table loaded once.

@pytest.fixture(scope="session")
def compacted_factory_store(factory_store, tmp_path_factory):
    """The factory's store compacted into parquet segments (what ``load_store`` reads)."""
    from kvobs.sources.store import compact

    store = str(tmp_path_factory.mktemp("factory-compacted") / "store")
    shutil.copytree(factory_store, store)
    compact(store, writers_stopped=True)
    return store


@pytest.fixture(scope="session")
def clickhouse(synthetic_store, chdb_path):
    """The synthetic store's spans in the exporter's default (Map) table."""
    source = chdb_table(chdb_path, "otel_traces", synthetic_store[0])
    assert source.count() == synthetic_store[1].spans
    return source


@pytest.fixture(scope="session")
def factory_clickhouse(compacted_factory_store, chdb_path):
    """The factory's spans (two tenants sharing an id) through the exporter's schema."""
    return chdb_table(chdb_path, "factory_traces", compacted_factory_store)


@pytest.fixture(scope="session")
def json_clickhouse(synthetic_store, chdb_path):
    """The synthetic store's spans in the exporter's JSON-attribute table."""
    source = chdb_table(chdb_path, "json_traces", synthetic_store[0], "json")
    assert source.count() == synthetic_store[1].spans
    return source


@pytest.fixture(scope="session")
def factory_json_clickhouse(compacted_factory_store, chdb_path):
    return chdb_table(chdb_path, "factory_json_traces", compacted_factory_store, "json")
