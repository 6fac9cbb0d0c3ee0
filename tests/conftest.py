import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def dist_pools():
    """``dist_pools(world)`` -> a shared ``DistPool`` of that size (spawned once per session)."""
    from dist_pool import DistPool

    pools: dict[int, DistPool] = {}

    def get(world: int) -> DistPool:
        if world not in pools:
            pools[world] = DistPool(world)
        return pools[world]

    yield get
    for pool in pools.values():
        # Not graceful: the session is over, and a worker's interpreter exit (destroying its
        # process group) took ~10 s of the suite for nothing.
        pool.close(graceful=False)


@pytest.fixture
def copy_of(pristine, tmp_path) -> Path:
    """A fresh copy of the module's ``pristine`` checkpoint (each checkpoint test module
    defines ``pristine``: one save, shared by its tests), safe to corrupt."""
    target = tmp_path / "ckpt"
    shutil.copytree(pristine, target)
    return target


@pytest.fixture
def patched_env():
    """``with patched_env(NAME="value"): ...`` (see tests/patching.py)."""
    from patching import patched_env

    return patched_env


@pytest.fixture
def patched_attr():
    """``with patched_attr(obj, "name", value): ...`` (see tests/patching.py)."""
    from patching import patched_attr

    return patched_attr


def pytest_collection_modifyitems(config, items) -> None:
    """Slow-marked tests run only with ``FLATSHARD_SLOW=1``: ``.ci/run`` runs them after the
    README's command (``pytest -q -m slow``), which stays within its time budget."""
    if os.environ.get("FLATSHARD_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with FLATSHARD_SLOW=1 (.ci/run does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
