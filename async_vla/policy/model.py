"""Tiny OpenVLA-shaped policy: conv vision encoder (patch and keypoint tokens) -> MLP projector -> transformers Llama
decoder (~1 M params), parallel (OFT) or autoregressive (OpenVLA) action positions, logits over the ``num_bins``
action tokens only, hashed word-level instructions. Design and its reasons: docs/ARCHITECTURE.md "The tiny policy"."""

from __future__ import annotations

import math
import re
import zlib
from functools import lru_cache
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

from async_vla.config import PolicyConfig
from async_vla.policy.interface import ArrayLike, VLAPolicy, sample_tokens
from async_vla.tokenizer import ActionTokenizer

PAD_ID, BOS_ID, EOS_ID, FIRST_ACTION_ROW = 0, 1, 2, 3
_WORD = re.compile(r"[a-z0-9]+")


def word_ids(instruction: str, max_tokens: int, buckets: int) -> tuple[list[int], list[int]]:
    """Two hashed bucket ids per word, ``max_tokens`` long: BOS (bucket 1), words (``2 .. buckets - 1``, two CRC32
    seeds), then PAD (bucket 0)."""
    words = _WORD.findall(instruction.lower())[: max_tokens - 1]
    first = [BOS_ID] + [2 + zlib.crc32(w.encode()) % (buckets - 2) for w in words]
    second = [BOS_ID] + [2 + zlib.crc32(w.encode(), 0x9E3779B9) % (buckets - 2) for w in words]
    pad = [PAD_ID] * (max_tokens - len(first))
    return first + pad, second + pad


@lru_cache(maxsize=8)
def sincos_2d(height: int, width: int, patch: int, dim: int) -> Tensor:
    """``[patches, dim]`` fixed position codes of the ``height/patch x width/patch`` patch grid, row-major (MAE's
    2-D sine-cosine code): the first half of ``dim`` codes the column, the second the row, each as sines then
    cosines of the coordinate at ``dim / 4`` frequencies ``10000 ** (-i / (dim / 4))``."""
    if dim % 4:
        raise ValueError(f"a 2-D sine-cosine code needs dim a multiple of 4, got {dim}")
    rows, cols = torch.meshgrid(torch.arange(height // patch, dtype=torch.float64),
                                torch.arange(width // patch, dtype=torch.float64), indexing="ij")
    omega = 10000.0 ** (-torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))

    def code(coord: Tensor) -> Tensor:
        angle = coord.reshape(-1, 1) * omega
        return torch.cat([angle.sin(), angle.cos()], dim=1)

    return torch.cat([code(cols), code(rows)], dim=1).float()


def shifted_fourier_logits(coef: Tensor, shift: Tensor, basis: Tensor, freqs: Tensor) -> Tensor:
    """Logits ``[..., bins]`` of the Fourier series with coefficients ``coef [..., 1 + 2F]`` (constant, cosines,
    sines at ``freqs [F]``, as the columns of ``basis [bins, 1 + 2F]`` over the bin coordinate u in [0, 1]) evaluated
    at ``u - shift`` (``shift [..., 1]``): each frequency's (cos, sin) pair rotated by ``pi * f * shift``."""
    n = freqs.shape[0]
    phi = torch.pi * shift * freqs
    c, s = coef[..., 1:n + 1], coef[..., n + 1:]
    cos, sin = phi.cos(), phi.sin()
    return torch.cat([coef[..., :1], c * cos - s * sin, c * sin + s * cos], dim=-1) @ basis.T


class TinyVLA(VLAPolicy):
    """Design: docs/ARCHITECTURE.md "The tiny policy". ``policy_cfg`` is kept for saving; ``tokenizer`` for ids and
    un-normalising."""

    def __init__(self, policy_cfg: PolicyConfig, tokenizer: ActionTokenizer):
        super().__init__()
        if tokenizer.num_bins != policy_cfg.num_bins or tokenizer.vocab_size != policy_cfg.vocab_size:
            raise ValueError("tokenizer and policy config disagree on num_bins / vocab_size")
        self.policy_cfg = policy_cfg
        self.tokenizer = tokenizer
        self.tokens_per_call = policy_cfg.chunk_size * policy_cfg.action_dim
        self.decoding = policy_cfg.decoding
        h = policy_cfg.hidden_size
        self.llm_config = LlamaConfig(
            # The fourier head keeps its action embeddings outside the Llama table, which then holds specials only.
            vocab_size=FIRST_ACTION_ROW + (policy_cfg.num_bins if policy_cfg.action_head == "free" else 0),
            hidden_size=h, intermediate_size=policy_cfg.intermediate_size,
            num_hidden_layers=policy_cfg.num_layers, num_attention_heads=policy_cfg.num_heads,
            num_key_value_heads=policy_cfg.num_heads, max_position_embeddings=512, tie_word_embeddings=True,
            bos_token_id=BOS_ID, pad_token_id=PAD_ID, eos_token_id=EOS_ID, attn_implementation="sdpa")
        self.llm = LlamaForCausalLM(self.llm_config)
        p, k = policy_cfg.patch_size, policy_cfg.keypoints
        # Vision (docs/ARCHITECTURE.md "The tiny policy"): stem, patch tokens, keypoints, language keypoints.
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GELU())
        self.max_patches = 256
        if policy_cfg.patch_tokens:
            self.patch = nn.Conv2d(32, h, p, stride=p)
        if policy_cfg.patch_tokens and policy_cfg.patch_pos == "learned":
            self.patch_pos = nn.Parameter(torch.randn(self.max_patches, h) * 0.02)
        if k:
            self.kp_maps = nn.Conv2d(32, k, 3, padding=1)
            # A sharp initial softmax makes each keypoint track the most salient blob of its map from the start.
            self.kp_log_temp = nn.Parameter(torch.full((k,), math.log(0.5)))
            self.kp_proj = nn.Linear(3, h)
            self.kp_id = nn.Parameter(torch.randn(k, h) * 0.02)
            self.kp_context = nn.Linear(3 * k, h)
            m = policy_cfg.lang_keypoints
            if m:
                self.lang_query = nn.Linear(h, m * k)
                self.lang_log_temp = nn.Parameter(torch.full((m,), math.log(0.5)))
                self.lang_proj = nn.Linear(3, h)
                self.lang_id = nn.Parameter(torch.randn(m, h) * 0.02)
                self.lang_context = nn.Linear(3 * m, h)
        self.projector = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Linear(h, h))
        if policy_cfg.action_head in ("fourier", "fourier_shift"):
            # Action-token embeddings = basis(bin) @ action_proj: smooth in the bin index by construction.
            u = torch.arange(policy_cfg.num_bins, dtype=torch.float32) / (policy_cfg.num_bins - 1)
            f = torch.arange(1, policy_cfg.action_head_freqs + 1, dtype=torch.float32)
            basis = torch.cat([torch.ones(len(u), 1), torch.cos(torch.pi * u[:, None] * f),
                               torch.sin(torch.pi * u[:, None] * f)], dim=1)
            self.register_buffer("action_basis", basis, persistent=False)
            self.register_buffer("action_freqs", f, persistent=False)
            self.action_proj = nn.Parameter(torch.randn(basis.shape[1], h) * 0.02)
        if policy_cfg.action_head == "fourier_shift":
            # Zero at initialisation: the head starts as the plain fourier head.
            self.action_shift = nn.Linear(h, 1)
            nn.init.zeros_(self.action_shift.weight)
            nn.init.zeros_(self.action_shift.bias)
        if policy_cfg.keypoint_shift:
            # Zero at initialisation too: a linear readout of every keypoint coordinate, one shift per action position.
            self.point_shift = nn.Linear(3 * (k + policy_cfg.lang_keypoints), self.tokens_per_call)
            nn.init.zeros_(self.point_shift.weight)
            nn.init.zeros_(self.point_shift.bias)
        self.proprio_proj = nn.Linear(policy_cfg.proprio_dim, h)
        self.action_queries = nn.Parameter(torch.randn(self.tokens_per_call, h) * 0.02)
        self.action_start = nn.Parameter(torch.randn(h) * 0.02)
        self.word_embed = nn.Embedding(policy_cfg.word_buckets, h)
        nn.init.normal_(self.word_embed.weight, std=0.02)
        self._instr_cache: dict[str, tuple[list[int], list[int]]] = {}

    # ---- prefix -----------------------------------------------------------------------------------
    def _images(self, images: ArrayLike) -> Tensor:
        x = torch.as_tensor(images, device=self.device)
        if x.dtype == torch.uint8:
            x = x.float().div_(127.5).sub_(1.0)
        # In the parameters' dtype: DeepSpeed's bf16 engine (a GPU learner) casts the module, not its inputs.
        return x.to(self.stem[0].weight.dtype).permute(0, 3, 1, 2)  # [B, H, W, 3] -> [B, 3, H, W]

    def _instruction_embeds(self, instructions: Sequence[str]) -> Tensor:
        rows1, rows2 = [], []
        for s in instructions:
            ids = self._instr_cache.get(s)
            if ids is None:
                if len(self._instr_cache) > 4096:  # bound the cache; instructions repeat in practice
                    self._instr_cache.clear()
                ids = word_ids(s, self.policy_cfg.max_instruction_tokens, self.policy_cfg.word_buckets)
                self._instr_cache[s] = ids
            rows1.append(ids[0])
            rows2.append(ids[1])
        ids = torch.tensor([rows1, rows2], dtype=torch.long, device=self.device)
        return self.word_embed(ids[0]) + self.word_embed(ids[1])

    def prefix_embeds(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str]
                      ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """Prefix ``[B, patches (if patch_tokens) + keypoints + 1 + max_instruction_tokens, hidden]``, a context
        ``[B, hidden]`` (proprio + mean instruction embedding + all keypoints), also added to every action position,
        and the keypoint-shift head's extra shift per action position ``[B, tokens_per_call]`` (None without it)."""
        feats = self.stem(self._images(images))  # [B, 32, H, W]
        if self.policy_cfg.patch_tokens:
            x = self._patch_tokens(feats)
        else:
            x = feats.new_zeros(len(feats), 0, self.policy_cfg.hidden_size)
        prop = torch.as_tensor(proprio, device=self.device, dtype=self.proprio_proj.weight.dtype)
        if prop.shape[-1] != self.policy_cfg.proprio_dim:
            raise ValueError(f"proprio has {prop.shape[-1]} dims, the policy expects {self.policy_cfg.proprio_dim}")
        prop = self.proprio_proj(prop)
        words = self._instruction_embeds(instructions)
        context = prop + words.mean(1)
        points = []
        if self.policy_cfg.keypoints:
            maps = self.kp_maps(feats).flatten(2)  # [B, K, H*W]
            # Standardise each map over space: a small blob then stands out by several sigma whatever the scale
            # of the conv weights, so the softmax is sharp (keypoints track objects) from initialisation on.
            maps = (maps - maps.mean(-1, keepdim=True)) / (maps.std(-1, keepdim=True) + 1e-2)
            kp = self._spatial_softmax(maps, self.kp_log_temp, feats.shape[-2:])  # [B, K, 3]
            x = torch.cat([x, self.kp_proj(kp) + self.kp_id], dim=1)
            context = context + self.kp_context(kp.flatten(1))
            points.append(kp.flatten(1))
            if self.policy_cfg.lang_keypoints:
                mix = self.lang_query(words.mean(1)).view(len(maps), self.policy_cfg.lang_keypoints, -1)
                lang = self._spatial_softmax(torch.einsum("bmk,bkp->bmp", mix, maps), self.lang_log_temp,
                                             feats.shape[-2:])
                x = torch.cat([x, self.lang_proj(lang) + self.lang_id], dim=1)
                context = context + self.lang_context(lang.flatten(1))
                points.append(lang.flatten(1))
        x = self.projector(x)
        # /16: on the built-in table a keypoint unit (one block cell) is a sixteenth of the bin coordinate of a reach,
        # so weights of order one express it and Adam's steps stay small against them.
        shift = self.point_shift(torch.cat(points, dim=1) / 16.0) if self.policy_cfg.keypoint_shift else None
        return torch.cat([x, prop.unsqueeze(1), words], dim=1), context, shift

    def _patch_tokens(self, feats: Tensor) -> Tensor:
        """``feats [B, 32, H, W]`` -> ``[B, patches, hidden]`` with their position code."""
        x = self.patch(feats).flatten(2).transpose(1, 2)
        if x.shape[1] > self.max_patches:
            raise ValueError(f"too many image patches ({x.shape[1]} > {self.max_patches}); raise patch_size")
        if self.policy_cfg.patch_pos == "learned":
            return x + self.patch_pos[: x.shape[1]]
        return x + sincos_2d(*feats.shape[-2:], self.policy_cfg.patch_size, x.shape[-1]).to(x)

    @staticmethod
    def _spatial_softmax(maps: Tensor, log_temp: Tensor, hw) -> Tensor:
        """``maps [B, M, H*W]`` -> ``[B, M, 3]``: expected x, expected y and peak activation of each map."""
        hh, ww = hw
        attn = torch.softmax(maps * torch.exp(-log_temp)[:, None], dim=-1)
        grid_x = torch.linspace(-1.0, 1.0, ww, device=maps.device, dtype=maps.dtype).repeat(hh)
        grid_y = torch.linspace(1.0, -1.0, hh, device=maps.device, dtype=maps.dtype).repeat_interleave(ww)  # row 0 = far edge (+y)
        # Scaled so a quarter-table shift is a unit change: small input variations make Adam learn the
        # dependence on them several times slower (measured).
        return torch.stack([4.0 * (attn * grid_x).sum(-1), 4.0 * (attn * grid_y).sum(-1), maps.amax(-1) / 10.0],
                           dim=-1)

    def _action_table(self) -> Tensor:
        """``[num_bins, hidden]`` embeddings of the action tokens (also the output rows of the action head, which
        fourier_shift shifts per position)."""
        if self.policy_cfg.action_head != "free":
            # The basis is a buffer: DeepSpeed's bf16 engine casts parameters, not buffers.
            return self.action_basis.to(self.action_proj.dtype) @ self.action_proj
        return self.llm.lm_head.weight[FIRST_ACTION_ROW:]

    def _action_head(self, hidden: Tensor, point_shift: Optional[Tensor]) -> Tensor:
        """Logits ``[..., num_bins]`` of action positions ``hidden [..., hidden_size]``; ``point_shift [...]``: the
        keypoint-shift head's extra shift of each (None without it)."""
        if self.policy_cfg.action_head != "fourier_shift":
            return F.linear(hidden, self._action_table())
        shift = self.action_shift(hidden)
        if point_shift is not None:
            shift = shift + point_shift.unsqueeze(-1)
        return shifted_fourier_logits(F.linear(hidden, self.action_proj), shift,
                                      self.action_basis.to(hidden.dtype), self.action_freqs.to(hidden.dtype))

    def _action_embeds(self, idx: Tensor) -> Tensor:
        """Bin indices (0..num_bins-1, not token ids) -> input embeddings."""
        return F.embedding(idx, self._action_table())

    # ---- interface --------------------------------------------------------------------------------
    def action_logits(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str],
                      action_tokens: Optional[Tensor]) -> Tensor:
        prefix, context, point_shift = self.prefix_embeds(images, proprio, instructions)
        b, t = prefix.shape[0], self.tokens_per_call
        queries = self.action_queries.unsqueeze(0) + context.unsqueeze(1)
        if self.decoding == "autoregressive":
            if action_tokens is None:
                raise ValueError("autoregressive decoding needs the action tokens to teacher-force on")
            prev = self._action_embeds(action_tokens[:, :-1])
            start = self.action_start.expand(b, 1, -1)
            queries = queries + torch.cat([start, prev], dim=1)
        out = self.llm.model(inputs_embeds=torch.cat([prefix, queries], dim=1), use_cache=False)
        return self._action_head(out.last_hidden_state[:, -t:], point_shift)

    def _sample(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str], temperature: float,
                generator: Optional[torch.Generator], greedy: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        if self.decoding == "parallel":
            return sample_tokens(self.action_logits(images, proprio, instructions, None), temperature, generator,
                                 greedy)
        prefix, context, point_shift = self.prefix_embeds(images, proprio, instructions)
        x = torch.cat([prefix, (self.action_queries[0] + self.action_start + context).unsqueeze(1)], dim=1)
        out = self.llm.model(inputs_embeds=x, use_cache=True)
        idxs, logps = [], []
        for i in range(self.tokens_per_call):
            head = self._action_head(out.last_hidden_state[:, -1], None if point_shift is None else point_shift[:, i])
            idx, logp = sample_tokens(head, temperature, generator,
                                      None if greedy is None else greedy[i])
            idxs.append(idx)
            logps.append(logp)
            if i + 1 == self.tokens_per_call:
                break
            x = (self.action_queries[i + 1] + context + self._action_embeds(idx)).unsqueeze(1)
            out = self.llm.model(inputs_embeds=x, past_key_values=out.past_key_values, use_cache=True)
        return torch.stack(idxs, 1), torch.stack(logps, 1)

