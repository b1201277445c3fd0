"""Integration tests start real processes on 127.0.0.1 (DHT nodes, p2pd, servers, trainers): each gets the
`integration` marker, so `-m "not integration"` leaves them out of a run that collects both folders."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.integration)
