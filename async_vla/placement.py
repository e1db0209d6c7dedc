"""Device placement on a GPU host (the ``placement`` section): each child of bin/train is placed by its
``CUDA_VISIBLE_DEVICES`` (the learner: its ranks' GPUs in rank order; each actor: one GPU), the evaluator gets a
``cuda:<index>`` device, indices as the launcher sees the GPUs (docs/GPU.md "Placement"). A learner rank claims
its GPU (``claim_learner_device``) before it builds anything. Starts no process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional, Sequence

if TYPE_CHECKING:
    from async_vla.config import Config

VISIBLE = "CUDA_VISIBLE_DEVICES"


def _physical(indices: Sequence[int], parent_env: Mapping[str, str], field: str) -> str:
    visible = parent_env.get(VISIBLE)
    if visible is None or visible.strip() == "":
        return ",".join(str(i) for i in indices)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    bad = [i for i in indices if i >= len(ids)]
    if bad:
        raise ValueError(f"placement.{field} names GPU {bad[0]} but this process sees only {len(ids)} "
                         f"({VISIBLE}={visible}): use indices 0..{len(ids) - 1}")
    return ",".join(ids[i] for i in indices)


def learner_env(cfg: "Config", parent_env: Mapping[str, str]) -> dict[str, str]:
    """Environment overrides for the learner process (all ranks), {} when placement.gpus_learner is unset."""
    gpus = cfg.placement.gpus_learner
    return {} if gpus is None else {VISIBLE: _physical(gpus, parent_env, "gpus_learner")}


def learner_rank_device(local_rank: int, cuda_devices: int) -> str:
    """The device of learner rank ``local_rank`` seeing ``cuda_devices`` GPUs: ``cuda:<local_rank>``, or ``cpu`` without
    CUDA; a rank past its GPUs is an error naming the fix."""
    if cuda_devices == 0:
        return "cpu"
    if not 0 <= local_rank < cuda_devices:
        raise ValueError(f"learner rank with LOCAL_RANK={local_rank} sees {cuda_devices} GPU(s): one GPU per rank is "
                         f"needed (NCCL cannot run two ranks on one GPU); give the learner as many GPUs as ranks "
                         f"(placement.gpus_learner, or {VISIBLE}) or set learner.num_ranks={cuda_devices}")
    return f"cuda:{local_rank}"


def claim_learner_device(env: Mapping[str, str]) -> str:
    """Make this rank's GPU (``learner_rank_device`` of its ``LOCAL_RANK``) the current CUDA device and return it;
    called before any model is built, so nothing lands on GPU 0 by default."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = learner_rank_device(int(env.get("LOCAL_RANK", "0")), count)
    if device != "cpu":
        torch.cuda.set_device(device)
    return device


def actor_env(cfg: "Config", actor_id: int, parent_env: Mapping[str, str]) -> dict[str, str]:
    """Environment overrides for actor ``actor_id``: one GPU, round-robin over placement.gpus_actors."""
    gpus = cfg.placement.gpus_actors
    if gpus is None:
        return {}
    return {VISIBLE: _physical([gpus[actor_id % len(gpus)]], parent_env, "gpus_actors")}


def evaluator_device(cfg: "Config") -> Optional[str]:
    """The evaluator's torch device (it shares the launcher's view of the GPUs), None when unset."""
    gpu = cfg.placement.gpu_evaluator
    return None if gpu is None else f"cuda:{gpu}"


def placed(cfg: "Config") -> bool:
    """Whether the config places anything on a GPU (bin/train refuses that on a host without CUDA)."""
    p = cfg.placement
    return p.gpus_learner is not None or p.gpus_actors is not None or p.gpu_evaluator is not None


def shared_weight_gpu(cfg: "Config") -> Optional[str]:
    """Why two members of the weight broadcast group would share one GPU on this host (NCCL refuses that, so
    weights.backend=auto takes gloo), or None. Decided for one-host runs only (Slurm and Ray put actors elsewhere)."""
    from async_vla.hosts import is_loopback

    if cfg.run.launcher != "local" or not is_loopback(cfg.transport.host):
        return None
    p, n = cfg.placement, cfg.actor.num_actors
    learner_gpu = 0 if p.gpus_learner is None else p.gpus_learner[0]
    if p.gpus_actors is None:
        return "placement.gpus_actors is unset: every actor uses GPU 0, as learner rank 0 does"
    if learner_gpu in p.gpus_actors[:n]:
        return f"placement.gpus_actors {p.gpus_actors} includes learner rank 0's GPU {learner_gpu}"
    if n > len(p.gpus_actors):
        return f"{n} actors (actor.num_actors) share the {len(p.gpus_actors)} GPUs of placement.gpus_actors"
    return None
