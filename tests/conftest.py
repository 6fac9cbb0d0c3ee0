import os

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
        pool.close()
