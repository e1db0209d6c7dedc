"""The image steps OpenVLA-OFT / SimpleVLA-RL apply to a LIBERO frame before the checkpoint's processor, in numpy /
PIL where upstream uses TensorFlow: JPEG round-trip (quality 95, 4:2:0), Lanczos-3 antialiased resize, and
``center_crop_resize`` following ``tf.image.crop_and_resize``'s sampling and uint8 conversion exactly. Upstream
order and how close each step agrees: docs/FIDELITY.md. Also ``random_shift``, the DrQ / RAD training-time
augmentation (``actor.image_shift``, ``bin/sft --image-shift``)."""

from __future__ import annotations

import io

import numpy as np

CROP_AREA = 0.9      # rob_rollout.py center_crop_image: crop_scale = 0.9 (of the area)
JPEG_QUALITY = 95    # tf.image.encode_jpeg's default quality


def jpeg_roundtrip(img: np.ndarray) -> np.ndarray:
    """Encode ``[H, W, 3] uint8`` as JPEG and decode it again (the RLDS training images were stored as JPEG)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(img, dtype=np.uint8)).save(buf, format="JPEG", quality=JPEG_QUALITY,
                                                                      subsampling="4:2:0")
    buf.seek(0)
    return np.asarray(Image.open(buf).convert("RGB"), dtype=np.uint8)


def lanczos_resize(img: np.ndarray, size: int) -> np.ndarray:
    """``[H, W, 3] uint8`` -> ``[size, size, 3] uint8`` with PIL's antialiased Lanczos (a = 3)."""
    from PIL import Image

    if img.shape[0] == size and img.shape[1] == size:
        return np.ascontiguousarray(img, dtype=np.uint8)
    return np.asarray(Image.fromarray(np.ascontiguousarray(img, dtype=np.uint8)).resize((size, size),
                                                                                         Image.LANCZOS))


def _crop_axis(n_in: int, n_out: int, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample positions of ``tf.image.crop_and_resize`` along one axis: (floor index, ceil index, lerp weight)."""
    lo, hi = np.float32(lo), np.float32(hi)        # TF computes the boxes and positions in float32
    if n_out > 1:
        scale = (hi - lo) * np.float32(n_in - 1) / np.float32(n_out - 1)
        pos = lo * np.float32(n_in - 1) + np.arange(n_out, dtype=np.float32) * scale
    else:
        pos = np.full(1, np.float32(0.5) * (lo + hi) * np.float32(n_in - 1), dtype=np.float32)
    below = np.floor(pos).astype(np.int64)
    above = np.ceil(pos).astype(np.int64)
    return np.clip(below, 0, n_in - 1), np.clip(above, 0, n_in - 1), pos - below


def center_crop_resize(img: np.ndarray, area: float = CROP_AREA, size: int | None = None) -> np.ndarray:
    """Centre crop of ``area`` of ``[H, W, 3] uint8`` (side ``sqrt(area)``), bilinearly resized to ``size``
    (default: the input's height), as SimpleVLA-RL's ``center_crop_image`` does in TensorFlow."""
    if not 0 < area <= 1:
        raise ValueError(f"crop area must be in (0, 1], got {area}")
    h, w = img.shape[:2]
    size = size or h
    side = np.clip(np.sqrt(np.float32(area)), 0, 1)
    off = (np.float32(1) - side) / np.float32(2)
    y0, y1, wy = _crop_axis(h, size, off, off + side)
    x0, x1, wx = _crop_axis(w, size, off, off + side)
    x = img.astype(np.float32) * np.float32(1.0 / 255.0)  # convert_image_dtype uint8 -> float32
    top = x[y0][:, x0] + (x[y0][:, x1] - x[y0][:, x0]) * wx[None, :, None]
    bottom = x[y1][:, x0] + (x[y1][:, x1] - x[y1][:, x0]) * wx[None, :, None]
    out = np.clip(top + (bottom - top) * wy[:, None, None], 0.0, 1.0)
    return (out * np.float32(255.5)).astype(np.uint8)                # convert_image_dtype float -> uint8, saturate=True


def random_shift(images: np.ndarray, pad: int, generator: np.random.Generator) -> np.ndarray:
    """DrQ's random shift of a batch ``[N, H, W, C]``: each image is edge-padded by ``pad`` pixels on every side and
    cropped back to ``H x W`` at its own offset (rows, columns), uniform in ``[0, 2 * pad]``: the draw is
    ``generator.integers(0, 2 * pad + 1, size=(2, N))`` (row offsets, then column offsets). The pixel-to-pixel
    geometry within an image is kept. ``pad = 0`` returns ``images`` itself and draws nothing."""
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(f"random_shift takes a batch [N, H, W, C], got shape {images.shape}")
    n, h, w = images.shape[:3]
    if not 0 <= pad < min(h, w):
        raise ValueError(f"pad must be in [0, {min(h, w)}) for {h}x{w} images, got {pad}")
    if pad == 0:
        return images
    dy, dx = generator.integers(0, 2 * pad + 1, size=(2, n))
    # Row i of the crop at offset dy is row dy + i of the padded image = row clip(dy + i - pad) of the original.
    rows = np.clip(dy[:, None] + np.arange(h) - pad, 0, h - 1)
    cols = np.clip(dx[:, None] + np.arange(w) - pad, 0, w - 1)
    return images[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
