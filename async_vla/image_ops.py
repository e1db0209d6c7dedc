"""The image steps OpenVLA-OFT / SimpleVLA-RL apply to a LIBERO frame before the checkpoint's own processor.

Upstream order (docs/FIDELITY.md): render 256 px -> rotate 180 deg -> JPEG round-trip -> Lanczos3 antialiased
resize to 224 (SimpleVLA-RL ``verl/utils/libero_utils.py`` ``get_libero_image`` / ``resize_image``, written by
OpenVLA-OFT to match the RLDS builder's JPEG storage) -> centre crop of 0.9 of the area, resized back to 224
(``verl/workers/rollout/rob_rollout.py`` ``center_crop_image`` / ``crop_and_resize``, only for checkpoints
trained with image augmentation: ``center_crop=True`` in ``examples/run_openvla_oft_rl_libero.sh``).

Upstream runs these in TensorFlow; here they are numpy/PIL:
- JPEG: PIL at quality 95 with 4:2:0 chroma subsampling, the defaults of ``tf.image.encode_jpeg``; both sides
  use libjpeg(-turbo), so decoded pixels agree up to the decoder's IDCT rounding.
- Lanczos: PIL's ``LANCZOS`` is the a = 3 kernel, widened when downscaling (antialiased), as
  ``tf.image.resize(method="lanczos3", antialias=True)``; the kernels' edge handling differs, so pixels agree to
  a few levels, not bit for bit.
- Centre crop: ``center_crop_resize`` follows ``tf.image.crop_and_resize``'s documented sampling exactly
  (bilinear, sample ``i`` at ``y1 (H - 1) + i (y2 - y1) (H - 1) / (h_out - 1)``) and ``convert_image_dtype``'s
  float -> uint8 conversion (``x * 255.5`` truncated), tested against a per-pixel reference.
"""

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
