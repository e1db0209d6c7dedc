"""The policy interface shared by actors and learner (docs/CONTRACTS.md); building, saving and loading:
``async_vla.policy.build``. Logits cover the ``num_bins`` action tokens only; behaviour (``act``) and learner
(``token_logprobs``) log-probs are ``log_softmax(action_logits / T)`` by the same code path. T = 0 is greedy, its
log-probs reported at T = 1."""

from __future__ import annotations

import abc
from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from async_vla.tokenizer import ActionTokenizer

ArrayLike = Union[np.ndarray, Tensor]


def effective_temperature(temperature: float) -> float:
    """Temperature used for log-probs: 0 (greedy) reports log-probs at 1."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


def sample_tokens(logits: Tensor, temperature: float, generator: Optional[torch.Generator] = None,
                  greedy: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Sample bin indices from ``logits [..., num_bins]``; returns (indices int64, log-probs float32).
    ``greedy``: bool, broadcastable to ``logits.shape[:-1]``: those positions take the argmax instead (their
    log-probs are still reported at ``temperature``)."""
    logp_all = F.log_softmax(logits.float() / effective_temperature(temperature), dim=-1)
    if temperature == 0:
        idx = logits.argmax(dim=-1)
    else:
        # Inverse-CDF sampling: one uniform per token (torch.multinomial draws more, at a real share of act()).
        cdf = logp_all.reshape(-1, logp_all.shape[-1]).exp().cumsum(-1)
        u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
        idx = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).reshape(logp_all.shape[:-1])
        if greedy is not None:
            idx = torch.where(greedy.to(idx.device), logits.argmax(dim=-1), idx)
    return idx, logp_all.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


class VLAPolicy(torch.nn.Module, abc.ABC):
    """Images + proprio + instruction -> ``tokens_per_call`` action tokens (one chunk)."""

    tokenizer: ActionTokenizer
    tokens_per_call: int

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @abc.abstractmethod
    def action_logits(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str],
                      action_tokens: Optional[Tensor]) -> Tensor:
        """Logits ``[B, T, num_bins]`` of every action position, teacher-forced on ``action_tokens`` where
        the decoding is autoregressive (ignored by parallel decoding)."""

    @abc.abstractmethod
    def _sample(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str], temperature: float,
                generator: Optional[torch.Generator], greedy: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """Bin indices and log-probs ``[B, T]`` of one sampled chunk (no grad); ``greedy`` (bool [T] or None):
        positions decoded by argmax (``sample_tokens``)."""

    def act(self, images: np.ndarray, proprio: np.ndarray, instructions: list[str], temperature: float,
            generator: Optional[torch.Generator] = None, greedy: Optional[np.ndarray] = None
            ) -> tuple[np.ndarray, np.ndarray]:
        """Sample one chunk per batch row: (action token ids int64 [B, T], behaviour log-probs float32 [B, T]).
        ``greedy`` (bool [T]): positions taken by argmax rather than sampled (``actor.sampled_dims``)."""
        if len(instructions) != len(images):
            raise ValueError(f"{len(images)} images but {len(instructions)} instructions")
        g = None
        if greedy is not None:
            g = torch.as_tensor(np.asarray(greedy, dtype=bool))
            if g.shape != (self.tokens_per_call,):
                raise ValueError(f"greedy must be a bool mask of {self.tokens_per_call} positions, got {tuple(g.shape)}")
        with torch.inference_mode():
            idx, logp = self._sample(images, proprio, instructions, temperature, generator, g)
        tokens = self.tokenizer.index_to_token(idx.cpu().numpy().astype(np.int64))
        return tokens, logp.cpu().numpy().astype(np.float32)

    def token_logprobs(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str],
                       action_tokens: Tensor, temperature: float) -> Tensor:
        """Differentiable log-probs ``[B, T]`` of given action token ids under ``log_softmax(logits / T)``."""
        logp_all, idx = self.action_log_softmax(images, proprio, instructions, action_tokens, temperature)
        return logp_all.gather(-1, idx.unsqueeze(-1)).squeeze(-1)

    def action_log_softmax(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str],
                           action_tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        """``log_softmax(logits / T)`` over the action bins ``[B, T, bins]`` and the tokens' bin indices."""
        tokens = torch.as_tensor(action_tokens, device=self.device).long()
        idx = self.tokenizer.token_to_index(tokens)
        if bool(((idx < 0) | (idx >= self.tokenizer.num_bins)).any()):
            raise ValueError("action_tokens contain ids outside the action-token range")
        logits = self.action_logits(images, proprio, instructions, idx)
        return F.log_softmax(logits.float() / effective_temperature(temperature), dim=-1), idx

    def token_logprobs_entropy(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str],
                               action_tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        """``token_logprobs`` and, from the same forward, the detached entropy ``[B, T]`` of each position's action
        distribution (logged, never a loss term: a graph for it would hold a ``[B, T, bins]`` tensor until the
        backward)."""
        logp_all, idx = self.action_log_softmax(images, proprio, instructions, action_tokens, temperature)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, idx.unsqueeze(-1)).squeeze(-1), entropy

    def decode_actions(self, action_tokens: np.ndarray) -> np.ndarray:
        """Token ids ``[B, T]`` -> un-normalised actions ``[B, chunk, dof]`` (float32)."""
        return self.tokenizer.decode_actions(np.asarray(action_tokens))
