"""Shared fixtures: the real embedded tiny policy (built once, cached) and the default config."""

import pytest

from rayrep.config import load_preset


@pytest.fixture(scope="session")
def tiny_cfg():
    return load_preset("tiny-cpu")


@pytest.fixture(scope="session")
def tiny_policy(tiny_cfg) -> str:
    """Path of the embedded tiny policy checkpoint (built on first use, ~3 min here)."""
    from rayrep.models import resolve_policy

    return resolve_policy(tiny_cfg)
