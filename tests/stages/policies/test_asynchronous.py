"""The asynchronous variants as policies: K, its cap and AdaSync's schedule."""

from __future__ import annotations

import numpy as np
import pytest
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.policies.asynchronous import AdaSync, KAsync, KBatchSync


def test_fixed_k_caps_to_live_workers():
    live = np.array([True, True, False, False])
    assert KAsync(3).choose(live) == 2
    assert KAsync(1, name="async").choose(live) == 1
    assert KBatchSync(2).choose(np.ones(4, dtype=bool)) == 2
    assert KAsync(3).mode == "k-async" and KBatchSync(3).mode == "k-batch-sync"
    with pytest.raises(ConfigError, match="k-async:0 needs K >= 1, got 0"):
        KAsync(0)


def test_adasync_doubles_k_every_period_gradients():
    policy = AdaSync(period=4)
    live = np.ones(8, dtype=bool)
    ks = []
    for _ in range(50):  # warm-up observations do not count
        policy.observe(np.ones(8), np.zeros(8, dtype=bool))
    for _ in range(12):
        ks.append(policy.choose(live))
    assert ks[:4] == [1, 1, 1, 1]
    assert ks[4:6] == [2, 2]
    assert ks[6] == 4
    assert ks[-1] == 8  # capped at the live workers
