"""``DeepSpeedLearner``: the learner step of ``learner.core`` on a DeepSpeed engine (ZeRO stage 0-3): a wrapper whose
``forward`` is ``policy.token_logprobs``, torch AdamW, non-finite steps skipped identically on every rank,
ZeRO-3 gathers for the full weights, checkpoints with per-rank RNG, and ZeRO-3 partitioning at build time so no GPU
holds the whole model. In full: docs/LEARNER.md "DeepSpeed engine in full"."""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from async_vla.batching import TrainBatch
from async_vla.config import Config
from async_vla.hosts import free_port
from async_vla.phases import PhaseClock
from async_vla.placement import claim_learner_device
from learner.checkpoint_files import capture_rng_state, restore_rng_state, tensors_digest
from learner.checkpoint_names import LATEST_FILE, checkpoint_tag, latest_tag, prune_checkpoints
from learner.core import Learner, frozen_copy, policy_has_entropy, save_policy_dir

log = logging.getLogger(__name__)

MODULE_PREFIX = "policy."


class LogProbModule(torch.nn.Module):
    """``forward`` = ``policy.token_logprobs``: what DeepSpeed wraps, so its hooks see every log-prob pass."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, images: Tensor, proprio: Tensor, instructions: list[str], action_tokens: Tensor,
                temperature: float, with_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        if with_entropy:   # the proximal pass: log-probs and per-token entropies from one forward
            return self.policy.token_logprobs_entropy(images, proprio, instructions, action_tokens, temperature)
        return self.policy.token_logprobs(images, proprio, instructions, action_tokens, temperature)


def resolve_precision(cfg: Config, on_gpu: bool) -> str:
    """``learner.precision`` -> "bf16" or "fp32" (auto: bf16 on GPU, fp32 on CPU)."""
    p = cfg.learner.precision
    if p == "auto":
        return "bf16" if on_gpu else "fp32"
    if p == "bf16" and not on_gpu:
        log.warning("learner.precision=bf16 on CPU: DeepSpeed's CPU bf16 path is slow; consider fp32")
    return p


def make_ds_config(cfg: Config, world: int, on_gpu: Optional[bool] = None) -> dict:
    """The DeepSpeed JSON generated from our config (docs/LEARNER.md "DeepSpeed engine")."""
    lc = cfg.learner
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    bf16 = resolve_precision(cfg, on_gpu) == "bf16"
    zero: dict[str, Any] = {"stage": lc.zero_stage}
    if lc.zero_stage >= 1:
        # overlap_comm needs side streams: GPU only. contiguous_gradients avoids fragmentation.
        zero.update({"contiguous_gradients": True, "overlap_comm": bool(on_gpu),
                     "reduce_bucket_size": 50_000_000})
    if lc.zero_stage == 3:
        zero.update({"stage3_param_persistence_threshold": lc.zero3_persistence_threshold,
                     "stage3_prefetch_bucket_size": 50_000_000,
                     "stage3_gather_16bit_weights_on_model_save": False})
    return {
        # Nominal: the learner accumulates over its own micro-batches (see batch_size_keys).
        **batch_size_keys(cfg, world),
        "gradient_clipping": lc.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "fp16": {"enabled": False},
        # Our AdamW is a torch optimizer DeepSpeed has not "tested" with ZeRO; it works (and needs no build).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def policy_load_kwargs(cfg: Config, device: str) -> dict:
    """``build_policy``'s ``device`` / ``dtype`` for a rank whose own device is ``device``: the CPU in the engine's
    dtype under ZeRO-3 (``DeepSpeedLearner`` partitions it onto ``device``), ``device`` otherwise."""
    if cfg.learner.zero_stage != 3:
        return {"device": device}
    bf16 = resolve_precision(cfg, device.startswith("cuda")) == "bf16"
    return {"device": "cpu", "dtype": torch.bfloat16 if bf16 else torch.float32}


def partition_zero3(module: torch.nn.Module, ds_config: dict, dtype: torch.dtype, device: torch.device) -> None:
    """Partition ``module``'s parameters over the ranks onto ``device`` (one full parameter there at a time, cast to
    ``dtype``) and move its buffers there, as a model built under ``zero.Init``. Every rank must call."""
    import deepspeed

    for p in module.parameters():
        if p.dtype != dtype and p.is_floating_point():
            p.data = p.data.to(dtype)
    deepspeed.zero.Init(module=module, config_dict_or_path=ds_config, dtype=dtype)
    for sub in module.modules():
        for name, buf in sub.named_buffers(recurse=False):
            sub._buffers[name] = buf.to(device)


def param_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the full parameters, bytes of parameter data this process holds): under ZeRO-3 its partitions plus
    any parameter held whole (persistence threshold, or gathered now); otherwise every parameter."""
    full = held = 0
    for p in module.parameters():
        size = p.element_size()
        full += int(getattr(p, "ds_numel", p.numel())) * size
        held += p.data.numel() * size
        part = getattr(p, "ds_tensor", None)
        if part is not None:
            held += part.numel() * part.element_size()
    return full, held


def batch_size_keys(cfg: Config, world: int) -> dict:
    mb = cfg.learner.micro_batch_trajectories
    return {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1, "train_batch_size": mb * world}


def load_ds_config(cfg: Config, world: int) -> dict:
    """``learner.deepspeed_config`` (JSON file) with our batch-size keys, or the generated config."""
    if cfg.learner.deepspeed_config is None:
        return make_ds_config(cfg, world)
    path = Path(cfg.learner.deepspeed_config)
    try:
        user = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"learner.deepspeed_config={path}: cannot read JSON: {exc}") from exc
    if not isinstance(user, dict):
        raise ValueError(f"learner.deepspeed_config={path}: the top level must be an object")
    return {**user, **batch_size_keys(cfg, world)}


def _loopback_store(cfg: Config) -> Optional[Any]:
    """Rank 0's rendezvous store bound to MASTER_ADDR itself when that is loopback (``env://`` alone listens on every
    interface); other ranks still join through ``env://``. None for other ranks, non-loopback masters and
    torchelastic's agent store."""
    import ipaddress

    from torch.distributed import PrefixStore, TCPStore

    addr = os.environ.get("MASTER_ADDR", "")
    try:
        loopback = addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        loopback = False
    if os.environ.get("RANK") != "0" or not loopback or "TORCHELASTIC_RUN_ID" in os.environ:
        return None
    host = "127.0.0.1" if addr == "localhost" else addr
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(os.environ["MASTER_PORT"])))
    sock.listen(128)
    timeout = datetime.timedelta(seconds=cfg.learner.dist_timeout_s)
    store = TCPStore(host, sock.getsockname()[1], int(os.environ["WORLD_SIZE"]), True, timeout,
                     wait_for_workers=False, master_listen_fd=sock.detach())
    return PrefixStore("default_pg", store)


def init_distributed(cfg: Config) -> tuple[int, int]:
    """Join (or create) the learner's process group from the torchrun / deepspeed variables (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK); without them a world of one on a free local port. Returns (rank, world)."""
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    # The shm comm op is only an inference all-reduce fast path and costs a long compile on a fresh host.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                               "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
                               "MASTER_PORT": os.environ.get("MASTER_PORT", str(free_port()))})
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        claim_learner_device(os.environ)     # learner/__main__ has already; a learner built elsewhere has not
        store = _loopback_store(cfg)
        if store is not None:  # deepspeed.init_distributed below adopts the initialized default group
            dist.init_process_group(backend, store=store, rank=0, world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=datetime.timedelta(seconds=cfg.learner.dist_timeout_s))
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(seconds=cfg.learner.dist_timeout_s))
    return dist.get_rank(), dist.get_world_size()


class DeepSpeedLearner(Learner):
    """ZeRO stage ``learner.zero_stage`` learner over all processes of the default process group."""

    def __init__(self, cfg: Config, policy: torch.nn.Module, phases: Optional[PhaseClock] = None):
        import deepspeed
        import torch.distributed as dist

        rank, world = init_distributed(cfg)
        super().__init__(cfg, policy, rank=rank, world=world, phases=phases)
        self._dist = dist
        self._zero_gather = deepspeed.zero.GatheredParameters
        self.stage = cfg.learner.zero_stage
        on_gpu = torch.cuda.is_available()
        self.precision = resolve_precision(cfg, on_gpu)
        self.ds_config = load_ds_config(cfg, world)
        # The KL reference is copied before its parameters are partitioned in place (ZeRO-3).
        ref = frozen_copy(policy) if self.uses_reference else None
        self.module = LogProbModule(policy)
        self.module.eval()  # no dropout: learner and actor log-probs agree at equal weights
        built_on = str(next(policy.parameters()).device)
        zero = self.ds_config.get("zero_optimization", {}).get("stage", 0)
        if zero == 3:
            dtype = torch.bfloat16 if self.ds_config.get("bf16", {}).get("enabled") else torch.float32
            device = torch.device(f"cuda:{torch.cuda.current_device()}") if on_gpu else torch.device("cpu")
            for m in (self.module, ref):
                if m is not None:
                    partition_zero3(m, self.ds_config, dtype, device)
        lc = cfg.learner
        params = [p for p in self.module.parameters() if p.requires_grad]
        client_opt = None
        if "optimizer" not in self.ds_config:
            client_opt = torch.optim.AdamW(params, lr=lc.lr, betas=tuple(lc.betas), weight_decay=lc.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.module, optimizer=client_opt, model_parameters=params if client_opt is None else None,
            config=self.ds_config)
        self.stage = self.engine.zero_optimization_stage()
        # Unwrapped (ZeRO-0 fp32): DeepSpeed hands our AdamW the gradients unchecked, so we check them.
        self._own_skip_check = (self.engine.optimizer is getattr(self.engine, "basic_optimizer", None)
                                or not hasattr(self.engine.optimizer, "overflow"))
        self._dtype = next(self.module.parameters()).dtype
        self._has_entropy = policy_has_entropy(policy)
        self.ref_engine: Optional[Any] = None
        self.ref_module: Optional[torch.nn.Module] = None
        if ref is not None:
            if self.stage == 3:
                # Sharded like the policy (ZeRO-3 inference: an engine without an optimizer), as TRL and verl do
                # for their reference models: one more model in memory would defeat ZeRO-3.
                ref_cfg = {k: v for k, v in self.ds_config.items() if k not in ("optimizer", "scheduler")}
                self.ref_engine = deepspeed.initialize(model=LogProbModule(ref), config=ref_cfg)[0]
                self.ref_engine.eval()
            else:   # ZeRO 0-2 keep a whole policy on every rank anyway: the reference is one more, unwrapped
                self.ref_module = LogProbModule(ref.to(device=self.engine.device, dtype=self._dtype))
        full, held = param_bytes(self.module)
        self.placement = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                          "device": str(self.engine.device), "built_on": built_on, "param_bytes": full,
                          "param_bytes_here": held}
        log.info("rank %d/%d: DeepSpeed ZeRO-%d %s on %s (policy built on %s; holds %.2f of its %.2f GB of "
                 "parameters)%s", rank, world, self.stage, self.precision, self.engine.device, built_on, held / 1e9,
                 full / 1e9, " (+ KL reference)" if ref is not None else "")

    # ------------------------------------------------------------------------------------- hooks
    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.device)

    def _forward(self, module: Any, mb: TrainBatch, **kw: Any) -> Any:
        # bf16 engines hold bf16 weights; autocast lets a policy that builds float32 activations (images
        # converted from uint8, proprio) run against them. Images stay uint8: the policy converts them.
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._dtype == torch.bfloat16):
            return module(mb.images, mb.proprio.to(self._dtype), mb.instructions, mb.action_tokens, self.temperature,
                          **kw)

    def _logprobs(self, mb: TrainBatch) -> Tensor:
        return self._forward(self.engine, mb)

    def _logprobs_entropy(self, mb: TrainBatch) -> tuple[Tensor, Optional[Tensor]]:
        if not self._has_entropy:
            return self._logprobs(mb), None
        return self._forward(self.engine, mb, with_entropy=True)

    def _ref_logprobs(self, mb: TrainBatch) -> Tensor:
        ref = self.ref_engine if self.ref_engine is not None else self.ref_module
        if ref is None:
            raise RuntimeError("this learner was built without a KL reference (loss.kl_beta = 0)")
        return self._forward(ref, mb)

    def _begin_micro_batch(self, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)

    def _backward(self, loss: Tensor, finite: bool) -> None:
        if not finite:
            # Make the global gradient norm NaN on every rank, so DeepSpeed skips the step everywhere.
            loss = loss * float("nan")
        self.engine.backward(loss, scale_wrt_gas=False)

    def _optimizer_step(self, nonfinite_loss: bool) -> tuple[bool, float]:
        if self._own_skip_check:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
            bad = torch.tensor([float(nonfinite_loss or not bool(torch.isfinite(norm)))], device=self.device)
            if float(self._all_reduce(bad, "max")[0]) > 0:
                self.engine.zero_grad()
                return False, float(norm)
            self.engine.step()
            return True, float(norm)
        before = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return self.engine.skipped_steps == before, norm

    def _lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def _set_lr(self, lr: float) -> None:
        if self.engine.lr_scheduler is not None:
            raise ValueError("learner.lr_decay and a scheduler in learner.deepspeed_config both set the lr: keep one")
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def _pad_micro_batches(self, mbs: list[TrainBatch]) -> list[TrainBatch]:
        """ZeRO-3 forwards are collective: every rank runs the same number of micro-batches. Missing ones are
        the rank's first trajectory with an all-False mask (zero loss, zero gradient, zero weight)."""
        if self.world == 1:
            return mbs
        n = int(self._all_reduce(torch.tensor([float(len(mbs))]), "max")[0])
        if n > len(mbs):
            pad = mbs[0].select([0])
            pad.mask = torch.zeros_like(pad.mask)
            mbs = mbs + [pad] * (n - len(mbs))
        return mbs

    def _all_reduce(self, t: Tensor, op: str) -> Tensor:
        if self.world == 1:
            return t
        dist = self._dist
        orig_device, orig_dtype = t.device, t.dtype
        # nccl reduces only device tensors; gloo any. float64 is fine on both.
        buf = t.to(self.device).clone()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return buf.to(orig_device, orig_dtype)

    # ------------------------------------------------------------------------------ full weights
    def _module_groups(self) -> list[list[tuple[str, torch.nn.Parameter]]]:
        """Parameters grouped by owning module, in registration order (one gather per layer)."""
        groups: list[list[tuple[str, torch.nn.Parameter]]] = []
        owner = None
        for name, p in self.module.named_parameters():
            mod = name.rsplit(".", 1)[0]
            if mod != owner or not groups:
                groups.append([])
                owner = mod
            groups[-1].append((name, p))
        return groups

    def full_state_items(self, all_ranks: bool = False, copy: bool = True) -> Iterator[tuple[str, Tensor]]:
        from learner.adapt import merge_lora_items

        yield from merge_lora_items(self._gathered_items(all_ranks, copy), self.lora_scale)

    def _gathered_items(self, all_ranks: bool, copy: bool) -> Iterator[tuple[str, Tensor]]:
        want = all_ranks or self.rank == 0
        for group in self._module_groups():
            ctx = (self._zero_gather([p for _, p in group], modifier_rank=None) if self.stage == 3
                   else nullcontext())
            with ctx:
                items = []
                if want:
                    for name, p in group:
                        shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
                        full = p.data.reshape(shape).detach()
                        if copy:
                            items.append((name[len(MODULE_PREFIX):], full.clone()))
                        else:   # the consumer copies it while the module is gathered (the gather's memory only)
                            yield name[len(MODULE_PREFIX):], full
            yield from items  # cloned: outside the gather, so a slow consumer never holds shards gathered

    def local_optimizer_tensors(self) -> list[tuple[str, Tensor]]:
        """This rank's optimizer tensors: its fp32 master partition(s) and the AdamW state of them."""
        zero = self.engine.optimizer
        inner = zero
        while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
            inner = inner.optimizer
        if hasattr(inner, "optimizer") and isinstance(getattr(inner, "optimizer"), torch.optim.Optimizer):
            inner = inner.optimizer
        out: list[tuple[str, Tensor]] = []
        # ZeRO-3 empties the inner optimizer's param_groups between steps; the masters live on the wrapper.
        masters = (getattr(zero, "fp32_partitioned_groups_flat", None)
                   or getattr(zero, "single_partition_of_fp32_groups", None)
                   or [p for g in inner.param_groups for p in g["params"]])
        out += [(f"master{i}", t.data) for i, t in enumerate(masters)]
        for i, (_, st) in enumerate(inner.state.items()):  # insertion order: the same on save and load
            out += [(f"state{i}.{k}", v) for k, v in sorted(st.items()) if isinstance(v, Tensor)]
        return out

    def optimizer_digest(self) -> str:
        return tensors_digest(self.local_optimizer_tensors())

    # ------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str | Path, extra: Optional[dict] = None) -> Path:
        """Every rank must call. ``<dir>/v<version>/`` (DeepSpeed layout + rng_rank<r>.pt) and ``<dir>/latest``."""
        directory = Path(directory)
        tag = checkpoint_tag(self.version)
        (directory / tag).mkdir(parents=True, exist_ok=True)
        # RNG files before DeepSpeed writes `latest`, so a half-written checkpoint is never the latest.
        torch.save({"rng": capture_rng_state(), "streams": self._rank_streams()},
                   directory / tag / f"rng_rank{self.rank:05d}.pt")
        self._dist.barrier()
        self.engine.save_checkpoint(str(directory), tag=tag, client_state={"async_vla": self._learner_state(extra)},
                                    save_latest=True)
        self._dist.barrier()
        if self.rank == 0:
            prune_checkpoints(directory, self.cfg.learner.keep_checkpoints)
        self._dist.barrier()
        return directory / tag

    def load_checkpoint(self, directory: str | Path, tag: Optional[str] = None) -> dict:
        directory = Path(directory)
        tag = tag or latest_tag(directory)
        if tag is None:
            raise FileNotFoundError(f"no checkpoint in {directory} (no {LATEST_FILE} file)")
        path, client_state = self.engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                                         load_lr_scheduler_states=True)
        if path is None or not client_state or "async_vla" not in client_state:
            raise FileNotFoundError(f"{directory}/{tag} is not a complete async_vla learner checkpoint")
        extra = self._restore_learner_state(client_state["async_vla"])
        saved_world = client_state["async_vla"].get("world", self.world)
        if saved_world != self.world:
            log.warning("checkpoint was written by %d ranks, resuming with %d", saved_world, self.world)
        rng_file = directory / tag / f"rng_rank{self.rank:05d}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=False)
            restore_rng_state(rng["rng"])
            self._restore_rank_streams(rng.get("streams", rng))   # (before "streams": the generator at top level)
        else:
            log.warning("%s missing: RNG streams restart from their seeds", rng_file)
        self._dist.barrier()
        return extra

    def export_policy(self, directory: str | Path) -> Optional[Path]:
        """Every rank must call; rank 0 writes the policy (safetensors) into ``directory``."""
        from learner.adapt import merged_view

        directory = Path(directory)
        params = list(self.policy.parameters())
        ctx = self._zero_gather(params, modifier_rank=None) if self.stage == 3 else nullcontext()
        with ctx:
            if self.rank == 0:
                # ZeRO 1-2 keep the parameters as views of one flat buffer, and ZeRO-3 gathers them into one:
                # safetensors refuses to save those ("none is covering the entire storage"). Save copies with
                # storages of their own, then put the views back (the optimizer steps through them).
                views = [p.data for p in params]
                try:
                    for p in params:
                        p.data = p.data.clone()
                    with merged_view(self.policy, self.lora_scale):   # LoRA: the plain architecture, merged
                        save_policy_dir(self.policy, directory)
                finally:
                    for p, v in zip(params, views):
                        p.data = v
        self._dist.barrier()
        return directory if self.rank == 0 else None
