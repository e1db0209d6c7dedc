"""OpenVLA -> LIBERO action conversion: pure numpy, so it runs even where the simulator is not installed."""

import numpy as np
import pytest

from async_vla.envs.libero import to_libero_action

OPEN, CLOSE = 1.0, 0.0  # OpenVLA gripper convention (env.gripper_convention=openvla, the default)


def _act(gripper: float) -> np.ndarray:
    return np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, gripper], dtype=np.float32)


def test_action_conversion_openvla_to_libero():
    a = to_libero_action([2.0, -0.5, 0.1, 0.0, 0.0, np.nan, OPEN])
    np.testing.assert_array_equal(a, [1.0, -0.5, 0.1, 0.0, 0.0, 0.0, -1.0])  # clipped, NaN -> 0, open -> -1
    assert to_libero_action(_act(CLOSE))[6] == 1.0 and to_libero_action(_act(0.5))[6] == 0.0
    assert to_libero_action(_act(0.9))[6] == -1.0 and to_libero_action(_act(0.2))[6] == 1.0  # binarised
    assert to_libero_action(_act(0.7), gripper_convention="libero")[6] == pytest.approx(0.7)
    with pytest.raises(ValueError, match="7 entries"):
        to_libero_action(np.zeros(6))
