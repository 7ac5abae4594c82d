"""One local Ray instance for every Ray test of the session (starting one takes
seconds, most of these tests' time): 2 CPUs, no dashboard, a fresh cluster
(``address="local"``: never a cluster some ``ray start`` left running)."""

import os
import time

import pytest


@pytest.fixture(scope="session")
def ray_local():
    ray = pytest.importorskip("ray")
    started = time.perf_counter()
    # Workers inherit this process's environment (PYTHONPATH included) from the raylet.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}})
    print(f"ray.init took {time.perf_counter() - started:.1f} s")
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """A test that starts Ray is marked ``ray``: the default run leaves them out (Ray's
    start-up and each actor's engine take minutes on a small machine) and CI runs them
    in a stage of their own (``python -m pytest -m ray``, with ``.[ray]`` installed)."""
    for item in items:
        if "ray_local" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
