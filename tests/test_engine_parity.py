"""Parity of sharded training with single-process training on the global batch (fp32, AdamW)."""

import pytest

from parity_models import CASES, train_parity

TOLERANCE = 1e-5


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_full_shard_matches_single_process(dist_pools, name, world):
    r = dist_pools(world).run(train_parity, name)[0]
    assert r["none_mismatch"] == [], f"grad None-ness differs for {r['none_mismatch']}"
    assert r["grad_err"] <= TOLERANCE, f"{name} at world {world}: grad rel err {r['grad_err']:.2e}"
    assert r["sd_err"] <= TOLERANCE, f"{name} at world {world}: params rel err {r['sd_err']:.2e}"
    assert r["loss_err"] <= TOLERANCE, f"{name} at world {world}: loss rel err {r['loss_err']:.2e}"
    assert r["noisy_fraction"] < 0.01, f"{r['noisy_fraction']:.1%} of elements at the noise floor"
