"""random_shift (DrQ / RAD augmentation) against a slow per-image reference: np.pad(mode="edge") and slicing."""

import numpy as np
import pytest

from async_vla.image_ops import random_shift


def reference_shift(images: np.ndarray, pad: int, generator: np.random.Generator) -> np.ndarray:
    """One image at a time, as DrQ describes it: pad by replicating the border, crop at a random offset."""
    n, h, w = images.shape[:3]
    dy, dx = generator.integers(0, 2 * pad + 1, size=(2, n))
    out = np.empty_like(images)
    for k in range(n):
        padded = np.pad(images[k], ((pad, pad), (pad, pad), (0, 0)), mode="edge")
        out[k] = padded[dy[k]:dy[k] + h, dx[k]:dx[k] + w]
    return out


def crop_at(image: np.ndarray, pad: int, dy: int, dx: int) -> np.ndarray:
    h, w = image.shape[:2]
    return np.pad(image, ((pad, pad), (pad, pad), (0, 0)), mode="edge")[dy:dy + h, dx:dx + w]


@pytest.mark.parametrize("shape,pad", [((16, 8, 8, 3), 1), ((9, 12, 10, 3), 3), ((5, 32, 32, 1), 4),
                                       ((3, 6, 6, 3), 5)])
def test_random_shift_matches_the_per_image_reference(shape, pad):
    images = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)
    out = random_shift(images, pad, np.random.default_rng(7))
    assert out.dtype == np.uint8 and out.shape == images.shape
    np.testing.assert_array_equal(out, reference_shift(images, pad, np.random.default_rng(7)))
    assert not np.array_equal(out, images)


def test_every_offset_is_reachable_and_each_image_draws_its_own():
    pad = 2
    image = np.arange(6 * 6, dtype=np.uint8).reshape(1, 6, 6, 1) * 7   # every pixel distinct: offsets tell apart
    out = random_shift(np.repeat(image, 400, axis=0), pad, np.random.default_rng(1))
    crops = {(dy, dx): crop_at(image[0], pad, dy, dx) for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)}
    seen = [next(o for o, c in crops.items() if np.array_equal(c, img)) for img in out]
    assert set(seen) == set(crops)                                          # all 25 offsets, nothing else


def test_pad_zero_is_the_identity_and_bad_pads_are_named():
    images = np.random.default_rng(0).integers(0, 256, size=(4, 8, 8, 3), dtype=np.uint8)
    rng = np.random.default_rng(3)
    assert random_shift(images, 0, rng) is images
    assert rng.integers(1 << 30) == np.random.default_rng(3).integers(1 << 30)   # nothing drawn
    for bad in (-1, 8, 9):
        with pytest.raises(ValueError, match="pad"):
            random_shift(images, bad, rng)
    with pytest.raises(ValueError, match=r"\[N, H, W, C\]"):
        random_shift(images[0], 1, rng)
