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


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray cluster for one test module, stopped afterwards.

    `address="local"` never attaches to some other cluster running on the machine. Four
    logical CPUs on a 2-core machine: the roles take turns, as in a real run.
    """
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
