"""Shared pytest configuration (markers live in pyproject.toml).

Tests marked ``large`` need more than 20 GiB of memory and minutes of time; they are skipped
unless selected with ``-m large`` (any ``-m`` expression that mentions ``large``).
"""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "large" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="needs > 20 GiB of memory: run with -m large")
    for item in items:
        if "large" in item.keywords:
            item.add_marker(skip)
