"""offpolicy/behav_kl_stale: the behaviour/proximal KL over the tokens an older version sampled, where the
all-token average (offpolicy/behav_kl) is diluted by lag-0 tokens whose KL is 0 by construction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.torch_engine import TorchLearner
from tests.learner_helpers import StandInPolicy, make_traj, small_cfg


def _k3(prox: np.ndarray, behav: np.ndarray) -> np.ndarray:
    d = prox - behav
    return np.exp(d) - d - 1.0


@pytest.mark.parametrize("proximal_pass", ["auto", "always"])
def test_stale_kl_averages_over_lag_positive_tokens_only(proximal_pass):
    cfg = small_cfg("loss.correction=none", f"learner.proximal_pass={proximal_pass}")
    policy = StandInPolicy(seed=2)
    learner = TorchLearner(cfg, policy)
    learner.version = 3
    # group a: sampled by the current version (lag 0); group b: by version 1 with noisy behaviour log-probs
    fresh = [make_traj("a", j, 2, float(j % 2), version=3, seed=j, policy=policy) for j in range(2)]
    stale = [make_traj("b", j, 3, float(j % 2), version=1, seed=10 + j, policy=policy, behav_noise=0.3)
             for j in range(2)]
    with torch.no_grad():
        expected, counts = [], 0
        for t in stale:
            prox = policy.token_logprobs(torch.from_numpy(t.images), torch.from_numpy(t.proprio),
                                         [t.instruction] * t.num_calls, torch.from_numpy(t.action_tokens),
                                         1.0).double().numpy()
            expected.append(_k3(prox, t.behav_logprobs.astype(np.float64))[t.token_mask])
    expected = np.concatenate(expected)
    n_fresh = sum(int(t.token_mask.sum()) for t in fresh)
    m = learner.train_step([fresh, stale])
    assert m["offpolicy/behav_kl_stale"] == pytest.approx(float(expected.mean()), rel=1e-4)
    assert m["offpolicy/stale_token_frac"] == pytest.approx(len(expected) / (len(expected) + n_fresh))
    # the all-token figure is the stale one diluted by the lag-0 tokens (whose KL is ~0: same weights)
    assert m["offpolicy/behav_kl"] == pytest.approx(m["offpolicy/behav_kl_stale"] * m["offpolicy/stale_token_frac"],
                                                    rel=1e-3, abs=1e-7)


def test_stale_kl_is_zero_when_every_token_is_fresh():
    cfg = small_cfg("loss.correction=none")
    policy = StandInPolicy(seed=2)
    learner = TorchLearner(cfg, policy)
    groups = [[make_traj(g, j, 2, float(j % 2), version=0, seed=j, policy=policy) for j in range(2)]
              for g in ("a", "b")]
    m = learner.train_step(groups)
    assert m["offpolicy/behav_kl_stale"] == 0.0 and m["offpolicy/stale_token_frac"] == 0.0
