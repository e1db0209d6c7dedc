"""learner.lr_decay: the lr of each update (a pure function against a direct reference) and its effect on the
optimizer steps of the torch and single-rank DeepSpeed learners."""

import numpy as np
import pytest
import torch

from async_vla.config import ConfigError
from learner.torch_engine import TorchLearner
from learner.lr_schedule import lr_at
from tests.learner_helpers import StandInPolicy, make_groups, small_cfg


def _reference(version, lr, start, end, final):
    """np.interp over the schedule's corners (clamped at both ends)."""
    return float(np.interp(version, [start, end], [lr, final]))


@pytest.mark.parametrize("start,end,final", [(0, 1, 0.0), (3, 7, 1e-5), (24, 40, 0.0), (10, 11, 2e-4)])
def test_lr_at_matches_linear_interpolation(start, end, final):
    for v in range(0, 50):
        assert lr_at(v, 2e-4, (start, end), final) == pytest.approx(_reference(v, 2e-4, start, end, final), abs=1e-15)
    assert lr_at(17, 2e-4, None, 0.0) == 2e-4


@pytest.mark.parametrize("overrides,field", [
    (["learner.lr_decay=[5,5]"], "lr_decay"),
    (["learner.lr_decay=[-1,4]"], "lr_decay"),
    (["learner.lr=1e-4", "learner.lr_final=2e-4"], "lr_final"),
])
def test_bad_lr_decay_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        small_cfg(*overrides)


def _params(learner):
    return [t.clone() for _, t in learner.full_state_items()]


def _moved(a, b) -> bool:
    return any(not torch.equal(x, y) for x, y in zip(a, b))


def _schedule_seen(learner) -> list[tuple[float, bool]]:
    """(learner/lr, whether the weights moved) over four train steps on the same groups."""
    groups = make_groups(policy=StandInPolicy(seed=1), behav_noise=0.1)
    seen = []
    for _ in range(4):
        before = _params(learner)
        m = learner.train_step(groups)
        seen.append((m["learner/lr"], _moved(before, _params(learner))))
    return seen


# lr_decay=(0, 2), lr_final=0: v0 -> v1 at lr, v1 -> v2 at lr / 2, then lr 0 (the weights stay)
DECAYED = [(0.01, True), (0.005, True), (0.0, False), (0.0, False)]


def test_torch_learner_follows_lr_decay():
    assert _schedule_seen(TorchLearner(small_cfg("learner.lr_decay=[0,2]"), StandInPolicy(seed=1))) == DECAYED


def test_constant_lr_without_decay_keeps_moving():
    learner = TorchLearner(small_cfg(), StandInPolicy(seed=1))
    groups = make_groups(policy=StandInPolicy(seed=1), behav_noise=0.1)
    for _ in range(3):
        before = _params(learner)
        assert learner.train_step(groups)["learner/lr"] == 0.01 and _moved(before, _params(learner))


@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_learner_follows_lr_decay(dist_env, stage):
    from learner.deepspeed_engine import DeepSpeedLearner

    cfg = small_cfg(f"learner.zero_stage={stage}", "learner.lr_decay=[0,2]")
    assert _schedule_seen(DeepSpeedLearner(cfg, StandInPolicy(seed=1))) == DECAYED
