import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(scope="session")
def chdb_path(tmp_path_factory):
    """ClickHouse on chdb: one embedded server per process, so one database directory
    for every test (each test its own tables)."""
    pytest.importorskip("chdb")
    return str(tmp_path_factory.mktemp("chdb"))
