"""Fixtures for the model tests."""

from __future__ import annotations

import pytest
from bdsgd.stages.store import TraceStore

from tests.stages.model.clusters import tiny_store


@pytest.fixture
def tiny_traces(tmp_path) -> TraceStore:
    return tiny_store(tmp_path / "traces")
