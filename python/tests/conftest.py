"""One local cluster (a head and a 2-CPU worker of the regatta binary named by REGATTA_BIN)
for the whole pytest session."""

import pytest

import regatta


@pytest.fixture(scope="session", autouse=True)
def cluster():
    regatta.init(num_cpus=2)
    yield
    regatta.shutdown()
