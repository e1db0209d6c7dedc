"""Numerics: NaN or inf injected into the log-probs or only into the gradients -> the optimizer step is skipped and
counted, parameters and optimizer state are untouched (bit-equal) and finite, the batch is consumed (the version
moves on, so a poisoned batch is never served again), and training goes on. NaN / inf
behaviour log-probs from an actor never reach the learner: the wire rejects them (bad_logprob). The DeepSpeed
engine's skip (every ZeRO stage) is covered by tests/test_learner.py."""

import numpy as np
import pytest
import torch

from async_vla import messages as M
from learner.checkpoint_files import tensors_digest
from learner.torch_engine import TorchLearner
from learner_helpers import StandInPolicy, finite_params, make_groups, small_cfg


class _Poison(torch.autograd.Function):
    """Identity forward; the gradient is replaced by ``value`` (NaN or inf) everywhere."""

    @staticmethod
    def forward(ctx, x, value):  # type: ignore[override]
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return torch.full_like(g, ctx.value), None


class PoisonedPolicy(StandInPolicy):
    """``poison``: None, or (where, value) with where "logp" (forward) or "grad" (backward only)."""

    def token_logprobs(self, *args):
        logp = super().token_logprobs(*args)
        if self.poison is None:
            return logp
        where, value = self.poison
        if where == "logp":
            logp = logp.clone()
            logp[0, 0] = value
            return logp
        return _Poison.apply(logp, value)


@pytest.mark.parametrize("where", ["logp", "grad"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_step_is_skipped_and_counted(where, value):
    cfg = small_cfg()
    policy = PoisonedPolicy(seed=1)
    groups = make_groups(policy=policy)
    learner = TorchLearner(cfg, policy)
    learner.train_step(groups)  # a normal step first, so optimizer state exists too
    params, opt = tensors_digest(learner.full_state_items()), learner.optimizer_digest()
    policy.poison = (where, value)
    for k in (1, 2):
        m = learner.train_step(groups)
        assert m["learner/skipped_steps"] == k and learner.skipped_steps == k
        # the batch is consumed (version moves on, the buffer serves a fresh one), the weights are not touched
        assert m["learner/steps_applied"] == 0 and learner.version == 1 + k
    assert tensors_digest(learner.full_state_items()) == params and learner.optimizer_digest() == opt
    assert finite_params(learner.full_state_items())
    assert all(p.grad is None for p in policy.parameters())  # nothing left to leak into the next step
    policy.poison = None
    m = learner.train_step(groups)
    assert learner.version == 4 and m["learner/steps_applied"] == 1 and finite_params(learner.full_state_items())
    assert tensors_digest(learner.full_state_items()) != params


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 0.5])
def test_non_finite_behaviour_logprobs_never_cross_the_wire(value):
    from runner.faults.fuzz import template

    t = template(run_id="r")
    t.behav_logprobs[1, 3] = value
    with pytest.raises(M.MalformedMessage) as err:
        M.decode(M.encode(t))
    assert err.value.reason == "bad_logprob"
    t.token_mask[1, 3] = False   # a padded (never executed) token may hold anything: it is never trained on
    assert M.decode(M.encode(t)).traj_id == t.traj_id
