"""Weight publishing from the learner ranks: every rank joins the ZeRO-3 gathers, rank 0 hands the gathered
tensors to the ``WeightPublisher`` (``async_vla.weights``; design: docs/WEIGHTS.md), and optionally all ranks
check that what they gathered is what went out."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("learner")


def make_publisher(cfg: Any, run_dir: Path, lineage: str) -> Any:
    """Rank 0's ``WeightPublisher`` for the versions of learner ``lineage`` (a broken install fails here, loudly,
    instead of training without broadcast)."""
    from async_vla.weights import WeightPublisher

    return WeightPublisher(cfg, run_dir, lineage=lineage)


def publish_weights(learner: Any, publisher: Optional[Any], verify_ranks: bool = False) -> dict:
    """Every rank calls: rank 0 hands the gathered weights to the publisher, all ranks finish the gathers. With
    ``verify_ranks`` the ranks gather again and agree (all-reduce) that their checksums equal rank 0's published one."""
    import torch

    # No clone: the publisher copies each tensor into its bucket at once, inside the ZeRO-3 gather.
    items = learner.full_state_items(copy=False)
    stats: dict = {}
    t0 = time.perf_counter()
    try:
        if publisher is not None:
            stats = dict(publisher.publish(learner.version, items) or {})
    except Exception:  # noqa: BLE001 - a broken broadcast must not stop training (actors fall back)
        log.exception("weight publish of v%d failed", learner.version)
    finally:
        for _ in items:  # a publisher that stopped early must not leave the other ranks in a gather
            pass
    stats.setdefault("sync_s", time.perf_counter() - t0)
    if verify_ranks:
        from async_vla.weights import checksum

        mine = checksum(list(learner.full_state_items(all_ranks=True)))
        sent = float(stats.get("checksum", mine)) if publisher is not None else mine
        t = torch.tensor([mine, -mine, sent, -sent], dtype=torch.float64)
        hi_mine, neg_lo_mine, hi_sent, neg_lo_sent = learner._all_reduce(t, "max").tolist()
        ok = hi_mine == -neg_lo_mine == hi_sent == -neg_lo_sent  # every rank's gather == the broadcast checksum
        stats["rank_checksum_ok"] = float(ok)
        if not ok:
            log.error("v%d: learner ranks' gathered weights differ from the broadcast (checksums %s..%s vs %s)",
                      learner.version, -neg_lo_mine, hi_mine, hi_sent)
    return stats


def weight_metrics(stats: dict, version: int) -> dict[str, float]:
    """TensorBoard scalars (weights/*) of one publish's stats."""
    values = {"weights/sync_s": float(stats.get("sync_s", 0.0)), "weights/bytes": float(stats.get("bytes", 0)),
              "weights/receivers": float(stats.get("receivers", 0)),
              "weights/confirmed": float(stats.get("confirmed", 0)),
              "weights/version": float(version)}
    if "rank_checksum_ok" in stats:
        values["weights/rank_checksum_ok"] = stats["rank_checksum_ok"]
    return values


def close_publisher(publisher: Optional[Any]) -> None:
    """Wait for the last export, then release the publisher's store and group."""
    if publisher is not None:
        publisher.wait_export()
        publisher.close()
