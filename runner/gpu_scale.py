"""``bin/gpu-check --scale``: an OpenVLA-OFT-shaped 7.5 B model with random weights (nothing downloaded), measured
on one GPU through the project's actor and learner code: the actor's forward, a ZeRO-3 learner step (LoRA, and
full fine-tuning when it fits) and the weight hand-off. ``--size tiny`` runs it on a small model, CPU too. What is
built: docs/GPU.md "What bin/gpu-check --scale builds"."""

from __future__ import annotations

import gc
import json
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np
import torch

BEGIN, END = "<!-- gpu-check --scale: begin -->", "<!-- gpu-check --scale: end -->"
CHUNK, DIM = 8, 7                                   # LIBERO: 8 x 7 action tokens per call
VOCAB = 32064                                        # OpenVLA's padded LM head


@dataclass(frozen=True)
class Shape:
    """The sizes of one scale model and of its workload."""
    llm: dict
    siglip: dict
    dino: dict
    image: int
    calls: int            # policy calls per trajectory (512 steps / 8 at LIBERO's limit)
    envs: int = 8
    lora_rank: int = 32


SHAPES = {
    "7b": Shape(llm=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, max_position_embeddings=2048),
                siglip=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16),
                dino=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, mlp_ratio=4),
                image=224, calls=64),
    "tiny": Shape(llm=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, max_position_embeddings=512),
                  siglip=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
                  dino=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2),
                  image=224, calls=2, lora_rank=4),
}


class FusedVision(torch.nn.Module):
    """SigLIP and DINOv2 towers on the same 224 px image (6 channels: each tower's normalisation), patch features
    concatenated as Prismatic's fused backbone does: [B, 256, siglip + dino]."""

    def __init__(self, shape: Shape):
        super().__init__()
        from transformers import Dinov2Config, Dinov2Model, SiglipVisionConfig, SiglipVisionModel

        self.siglip = SiglipVisionModel(SiglipVisionConfig(image_size=shape.image, patch_size=14, **shape.siglip))
        self.dino = Dinov2Model(Dinov2Config(image_size=shape.image, patch_size=14, **shape.dino))
        self.embed_dim = shape.siglip["hidden_size"] + shape.dino["hidden_size"]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        siglip = self.siglip(pixel_values=pixel_values[:, :3]).last_hidden_state
        dino = self.dino(pixel_values=pixel_values[:, 3:]).last_hidden_state[:, 1:]     # without the CLS token
        return torch.cat([siglip, dino], dim=-1)


class OFTShapedVLA(torch.nn.Module):
    """OpenVLA-OFT's module layout (``vision_backbone``, ``projector``, ``language_model``) with SimpleVLA-RL's OFT
    forward contract: ``forward(input_ids, attention_mask, pixel_values)`` -> ``[B, 56, vocab]`` action logits."""

    def __init__(self, shape: Shape):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.vision_backbone = FusedVision(shape)
        llm = shape.llm["hidden_size"]
        v = self.vision_backbone.embed_dim
        self.projector = torch.nn.Sequential(torch.nn.Linear(v, 4 * v), torch.nn.GELU(), torch.nn.Linear(4 * v, llm),
                                             torch.nn.GELU(), torch.nn.Linear(llm, llm))
        self.language_model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **shape.llm))
        self.norm_stats = {"libero_spatial_no_noops": {"action": {"q01": [-1.0] * DIM, "q99": [1.0] * DIM}}}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        b, n = input_ids.shape[0], CHUNK * DIM
        ids = torch.cat([input_ids, torch.ones(b, n, dtype=input_ids.dtype, device=input_ids.device),
                         torch.full((b, 1), 2, dtype=input_ids.dtype, device=input_ids.device)], dim=1)
        emb = self.language_model.get_input_embeddings()(ids)
        keep = torch.ones(ids.shape[1], 1, dtype=emb.dtype, device=emb.device)
        keep[-n - 1:-1] = 0                                   # placeholders' embeddings zeroed, the stop's kept
        patches = self.projector(self.vision_backbone(pixel_values))
        mm = torch.cat([emb[:, :1], patches, (emb * keep)[:, 1:]], dim=1)
        mask = torch.ones(mm.shape[:2], dtype=attention_mask.dtype, device=attention_mask.device)
        logits = self.language_model(inputs_embeds=mm, attention_mask=mask, use_cache=False).logits
        start = patches.shape[1] + input_ids.shape[1] - 1
        return logits[:, start:start + n]


def processor(image: int) -> SimpleNamespace:
    """What ``OpenVLAPolicy`` asks of a processor: word-level prompt ids (BOS, then hashed words below the action
    ids) and 6-channel pixels (SigLIP's [-1, 1], DINOv2's ImageNet normalisation) at ``image`` px."""
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)

    def tokenizer(text: str, return_tensors: str = "pt") -> SimpleNamespace:
        return SimpleNamespace(input_ids=torch.tensor([[1] + [3 + zlib.crc32(w.encode()) % 29000 for w in text.split()]]))

    def image_processor(images, return_tensors: str = "pt") -> dict:
        x = torch.from_numpy(np.stack([np.asarray(im.resize((image, image)), dtype=np.float32) for im in images]))
        x = x.permute(0, 3, 1, 2) / 255.0
        return {"pixel_values": torch.cat([x * 2 - 1, (x - mean) / std], dim=1)}

    return SimpleNamespace(tokenizer=tokenizer, image_processor=image_processor)


def scale_config(shape: Shape, lora: bool, deepspeed_json: Optional[Path] = None) -> Any:
    """configs/libero_spatial.yaml's learner on one rank: ZeRO-3, gradient checkpointing, one trajectory per
    micro-batch, one optimizer step; LoRA rank ``shape.lora_rank`` when ``lora``."""
    from async_vla.config import load_config

    overrides = ["policy.path=random-weights", "learner.num_ranks=1", "actor.num_actors=1", "learner.minibatches=1",
                 "placement.gpus_learner=null", "placement.gpus_actors=null", "placement.gpu_evaluator=null",
                 "buffer.groups_per_batch=1", "actor.group_size=2", "learner.zero_stage=3",
                 f"learner.lora_rank={shape.lora_rank if lora else 0}", "learner.lr=1e-5",
                 "buffer.dynamic_sampling=false", "logging.tensorboard=false",
                 "learner.precision=auto"]           # bf16 on a GPU, fp32 on the CPU
    if deepspeed_json is not None:
        overrides.append(f"learner.deepspeed_config={deepspeed_json}")
    return load_config("configs/libero_spatial.yaml", overrides)


def build_scale_policy(shape: Shape, device: str, cfg: Any) -> Any:
    """A random OFT-shaped policy on ``device``: bf16 on a GPU (built in fp32 there, then cast), fp32 on the CPU."""
    from async_vla.policy.openvla_loader import OpenVLAPolicy

    with torch.device(device):
        model = OFTShapedVLA(shape)
    if device.startswith("cuda"):
        model = model.to(torch.bfloat16)
    return OpenVLAPolicy(model.eval(), processor(shape.image), cfg.policy)


def trajectories(shape: Shape, policy: Any) -> list:
    """One group of two trajectories of ``shape.calls`` calls (rewards 1 and 0), images at ``shape.image`` px."""
    from async_vla.messages import Trajectory

    rng = np.random.default_rng(0)
    first = policy.tokenizer.first_action_id
    out = []
    for i, reward in enumerate((1.0, 0.0)):
        n = shape.calls
        out.append(Trajectory(
            run_id="scale", actor_id=0, group_id="g", traj_id=f"g-{i}", task_id=0, init_state_id=0,
            instruction="put the black bowl on the plate", behaviour_version=0, success=reward > 0, reward=reward,
            env_steps=n * CHUNK, t_start=0.0, t_end=1.0, group_size=2, chunk_versions=np.zeros(n, dtype=np.int64),
            images=rng.integers(0, 256, (n, shape.image, shape.image, 3), dtype=np.uint8),
            proprio=np.zeros((n, 8), dtype=np.float32),
            action_tokens=rng.integers(first, first + 256, (n, CHUNK * DIM)).astype(np.int64),
            behav_logprobs=-rng.uniform(4.0, 6.0, (n, CHUNK * DIM)).astype(np.float32),
            token_mask=np.ones((n, CHUNK * DIM), dtype=bool)))
    return [out]


class Meter:
    """Wall seconds (synchronised on a GPU) and peak device memory of a block."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float, Optional[float]]:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0, torch.cuda.max_memory_allocated() / 1e9 if self.cuda else None


def _gb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}"


def actor_row(policy: Any, shape: Shape, meter: Meter) -> dict:
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (shape.envs, shape.image, shape.image, 3), dtype=np.uint8)
    proprio = np.zeros((shape.envs, 8), dtype=np.float32)
    instr = ["put the black bowl on the plate"] * shape.envs
    with torch.no_grad():
        for _ in range(2):                                          # warm-up (kernels, allocator)
            policy.act(images, proprio, instr, 1.6)
        times = []
        peak = None
        for _ in range(5):
            (toks, _), seconds, peak = meter(lambda: policy.act(images, proprio, instr, 1.6))
            times.append(seconds)
    assert toks.shape == (shape.envs, CHUNK * DIM)
    dtype = str(next(policy.parameters()).dtype).replace("torch.", "")
    return {"what": f"actor forward, {shape.envs} envs (one parallel pass, {dtype})",
            "value": f"{np.median(times) * 1e3:.1f} ms/call",
            "peak_gb": _gb(peak), "note": "median of 5"}


def learner_rows(cfg: Any, policy: Any, shape: Shape, meter: Meter, actor: Optional[Any], how: str) -> list[dict]:
    """One DeepSpeedLearner step (and, with ``actor``, the hand-off of its weights into ``actor``)."""
    from learner.deepspeed_engine import DeepSpeedLearner

    learner, init_s, _ = meter(lambda: DeepSpeedLearner(cfg, policy))
    groups = trajectories(shape, policy)
    metrics, step_s, step_peak = meter(lambda: learner.train_step(groups))
    steps = int(metrics.get("learner/steps_applied", 1))
    label = f"ZeRO-{learner.stage} {learner.precision}, {how}, gradient checkpointing"
    rows = [{"what": f"learner step, {label}", "value": f"{step_s:.2f} s",
             "peak_gb": _gb(step_peak), "note": f"2 micro-batches of 1 trajectory x {shape.calls} calls; "
                                                f"{steps} optimizer step; engine set-up {init_s:.0f} s"}]
    if actor is not None:
        params = dict(actor.named_parameters())

        def hand_off() -> int:
            n, seen = 0, set()
            with torch.no_grad():
                for name, t in learner.full_state_items(copy=False):
                    params[name].copy_(t)
                    n += t.numel() * t.element_size()
                    seen.add(name)
            if seen != set(params):
                raise RuntimeError(f"the hand-off missed {sorted(set(params) - seen)[:3]}")
            return n

        nbytes, seconds, peak = meter(hand_off)
        rows.append({"what": "weight hand-off to the actor (in process)", "value": f"{seconds:.2f} s",
                     "peak_gb": _gb(peak), "note": f"{nbytes / 1e9:.2f} GB: ZeRO-3 gather, LoRA merged, copied into "
                                                   f"the actor's model ({nbytes / 1e9 / seconds:.1f} GB/s)"})
    del learner
    return rows


def full_ft_plan(n_params: int, gpu_bytes: Optional[int], host_bytes: int) -> tuple[Optional[dict], str]:
    """(DeepSpeed zero_optimization additions, note) for full fine-tuning of ``n_params`` on one device with
    ``gpu_bytes`` (None: the CPU), or (None, why it is skipped): 16 bytes per parameter on the GPU under ZeRO-3 bf16
    AdamW plus ~15%, or with optimizer offload 4 on the GPU and 20 asked of the host."""
    if gpu_bytes is None:
        return {}, "no offload (CPU)"
    need, host_need = 16 * n_params * 1.15, 20 * n_params
    if need < gpu_bytes:
        return {}, f"no offload: ~{need / 1e9:.0f} GB of {gpu_bytes / 1e9:.0f} GB"
    if host_bytes >= host_need:
        return ({"offload_optimizer": {"device": "cpu", "pin_memory": False}},
                f"optimizer offloaded to the CPU (~{host_need / 1e9:.0f} GB of {host_bytes / 1e9:.0f} GB host RAM)")
    return None, (f"does not fit one GPU: ~{need / 1e9:.0f} GB without offload ({gpu_bytes / 1e9:.0f} GB here), "
                  f"~{host_need / 1e9:.0f} GB host RAM with the optimizer offloaded ({host_bytes / 1e9:.0f} GB here); "
                  "the configs/libero_*.yaml recipe shards it over 4 GPUs (docs/GPU.md)")


def run_scale(size: str, device: str, work_dir: Path) -> tuple[list[dict], dict]:
    """Every measurement of ``size`` on ``device``: (rows, facts). A failed measurement is a row saying so."""
    shape = SHAPES[size]
    meter = Meter(device)
    rows: list[dict] = []
    cfg = scale_config(shape, lora=True)
    torch.manual_seed(0)
    policy = build_scale_policy(shape, device, cfg)
    n_params = sum(p.numel() for p in policy.parameters())
    facts = {"size": size, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
             "params": n_params, "torch": torch.__version__, "cuda": torch.version.cuda,
             "date": time.strftime("%Y-%m-%d")}

    def attempt(what: str, fn: Callable[[], list[dict]]) -> None:
        try:
            rows.extend(fn())
        except Exception as exc:     # a failed measurement is a row of the table (OOM included), not the end
            rows.append({"what": what, "value": "FAIL", "peak_gb": "-", "note": f"{type(exc).__name__}: "
                                                                                f"{str(exc).splitlines()[0][:160]}"})
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    attempt("actor forward", lambda: [actor_row(policy, shape, meter)])
    actor = build_scale_policy(shape, device, cfg)                       # the actor's own copy, for the hand-off
    attempt("learner step, LoRA", lambda: learner_rows(cfg, policy, shape, meter, actor, f"LoRA r={shape.lora_rank}"))
    del policy
    import psutil

    gpu = (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if device.startswith("cuda")
           else None)
    plan, note = full_ft_plan(n_params, gpu, psutil.virtual_memory().total)
    if plan is None:
        rows.append({"what": "learner step, full fine-tuning", "value": "skipped", "peak_gb": "-", "note": note})
    else:
        from learner.deepspeed_engine import make_ds_config

        full = scale_config(shape, lora=False)
        ds = make_ds_config(full, 1, on_gpu=device.startswith("cuda"))
        ds["zero_optimization"].update(plan)
        if plan:
            ds["zero_force_ds_cpu_optimizer"] = False      # torch's AdamW steps the offloaded fp32 partition
        path = work_dir / "full_ft_deepspeed.json"
        path.write_text(json.dumps(ds))
        attempt("learner step, full fine-tuning",
                lambda: learner_rows(scale_config(shape, lora=False, deepspeed_json=path), actor, shape, meter, None,
                                     f"full fine-tuning, {note}"))
    return rows, facts


def table(rows: list[dict], facts: dict) -> str:
    head = (f"`bin/gpu-check --scale` on {facts['device']} ({facts['date']}; torch {facts['torch']}, CUDA "
            f"{facts['cuda']}; {facts['size']} shape, {facts['params'] / 1e6:,.0f} M parameters)\n\n")
    lines = ["| measurement | value | peak GB | note |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['value']} | {r['peak_gb']} | {r['note']} |" for r in rows]
    return head + "\n".join(lines)


def write_into_doc(doc: Path, text: str) -> None:
    """Replace what lies between the ``--scale`` markers of ``doc`` with ``text``."""
    body = doc.read_text()
    if BEGIN not in body or END not in body:
        raise ValueError(f"{doc} has no {BEGIN} ... {END} block to write the table into")
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    doc.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", body, count=1))
