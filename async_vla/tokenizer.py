"""OpenVLA-compatible action tokenizer: ``num_bins`` bins over [-1, 1], token ids ``vocab_size - num_bins ..
vocab_size - 1``, BOUNDS_Q99 normalisation on masked dims (the formulas: docs/FIDELITY.md "Action tokenizer")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class ActionStats:
    """Per-dimension action bounds of one dataset; ``mask[d]`` False = dimension passes through."""

    q01: np.ndarray
    q99: np.ndarray
    mask: np.ndarray

    def __post_init__(self) -> None:
        self.q01 = np.asarray(self.q01, dtype=np.float64)
        self.q99 = np.asarray(self.q99, dtype=np.float64)
        self.mask = np.asarray(self.mask, dtype=bool)
        if not (self.q01.shape == self.q99.shape == self.mask.shape) or self.q01.ndim != 1:
            raise ValueError(f"ActionStats q01/q99/mask must be 1-D of one length, got "
                             f"{self.q01.shape}, {self.q99.shape}, {self.mask.shape}")

    @classmethod
    def identity(cls, action_dim: int, gripper_last: bool = True) -> "ActionStats":
        """Bounds [-1, 1] on every dim (normalisation is then a no-op); the gripper passes through."""
        mask = np.ones(action_dim, dtype=bool)
        if gripper_last:
            mask[-1] = False
        return cls(-np.ones(action_dim), np.ones(action_dim), mask)

    @classmethod
    def from_actions(cls, actions: np.ndarray, gripper_last: bool = True) -> "ActionStats":
        """Statistics of a dataset of raw actions ``[N, D]`` (1st / 99th percentiles)."""
        actions = np.asarray(actions, dtype=np.float64).reshape(-1, np.shape(actions)[-1])
        mask = np.ones(actions.shape[1], dtype=bool)
        if gripper_last:
            mask[-1] = False
        return cls(np.quantile(actions, 0.01, axis=0), np.quantile(actions, 0.99, axis=0), mask)

    def to_dict(self) -> dict:
        return {"q01": self.q01.tolist(), "q99": self.q99.tolist(), "mask": self.mask.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "ActionStats":
        return cls(d["q01"], d["q99"], d["mask"])


@dataclass
class ActionTokenizer:
    """Actions <-> token ids. One policy call emits ``chunk_size * action_dim`` tokens, step-major."""

    vocab_size: int = 32000
    num_bins: int = 256
    chunk_size: int = 8
    action_dim: int = 7
    stats: dict[str, ActionStats] = field(default_factory=dict)
    unnorm_key: Optional[str] = None

    def __post_init__(self) -> None:
        if self.num_bins < 2 or self.num_bins > self.vocab_size:
            raise ValueError(f"num_bins must lie in [2, vocab_size], got {self.num_bins}")
        self.bins = np.linspace(-1.0, 1.0, self.num_bins)
        self.centres = (self.bins[:-1] + self.bins[1:]) / 2.0
        if self.unnorm_key is None and len(self.stats) == 1:
            self.unnorm_key = next(iter(self.stats))

    # ---- ids ---------------------------------------------------------------------------------------
    @property
    def first_action_id(self) -> int:
        """Lowest action token id (31744 for OpenVLA)."""
        return self.vocab_size - self.num_bins

    @property
    def tokens_per_call(self) -> int:
        return self.chunk_size * self.action_dim

    @property
    def bin_width(self) -> float:
        return 2.0 / (self.num_bins - 1)

    def greedy_positions(self, sampled_dims) -> Optional[np.ndarray]:
        """bool [tokens per call]: the positions taken greedily when only ``sampled_dims`` are sampled
        (``actor.sampled_dims``); None when every dimension is (``sampled_dims`` None)."""
        if sampled_dims is None:
            return None
        dims = [int(d) for d in sampled_dims]
        if not dims or not all(0 <= d < self.action_dim for d in dims):
            raise ValueError(f"sampled_dims {dims} must be action dimensions in 0..{self.action_dim - 1}")
        return ~np.isin(np.arange(self.chunk_size * self.action_dim) % self.action_dim, dims)

    def token_to_index(self, tokens):
        """Token id -> column of the restricted ``num_bins`` logits (works on numpy and torch)."""
        return tokens - self.first_action_id

    def index_to_token(self, index):
        return index + self.first_action_id

    # ---- normalised actions <-> tokens -------------------------------------------------------------
    def encode(self, actions_norm: np.ndarray) -> np.ndarray:
        """Normalised actions in [-1, 1] (any shape) -> int64 token ids of the same shape."""
        a = np.clip(np.asarray(actions_norm, dtype=np.float64), -1.0, 1.0)
        return (self.vocab_size - np.digitize(a, self.bins)).astype(np.int64)

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """Token ids (any shape) -> normalised actions (bin centres), float64."""
        idx = np.clip(self.vocab_size - np.asarray(tokens, dtype=np.int64) - 1, 0, self.num_bins - 2)
        return self.centres[idx]

    # ---- raw <-> normalised -----------------------------------------------------------------------
    def _stats(self, key: Optional[str]) -> Optional[ActionStats]:
        key = key if key is not None else self.unnorm_key
        if key is None:
            if not self.stats:
                return None  # no statistics: actions are already normalised
            raise KeyError(f"several action statistics ({sorted(self.stats)}): choose one with policy.unnorm_key")
        if key not in self.stats:
            raise KeyError(f"no action statistics for unnorm_key {key!r}; have {sorted(self.stats)}")
        return self.stats[key]

    def normalize(self, actions: np.ndarray, key: Optional[str] = None) -> np.ndarray:
        """Raw actions ``[..., D]`` -> normalised (BOUNDS_Q99 on masked dims, pass-through elsewhere)."""
        a = np.asarray(actions, dtype=np.float64)
        st = self._stats(key)
        if st is None:
            return a.copy()
        n = np.clip(2.0 * (a - st.q01) / (st.q99 - st.q01 + 1e-8) - 1.0, -1.0, 1.0)
        return np.where(st.mask, n, a)

    def unnormalize(self, actions_norm: np.ndarray, key: Optional[str] = None) -> np.ndarray:
        a = np.asarray(actions_norm, dtype=np.float64)
        st = self._stats(key)
        if st is None:
            return a.copy()
        return np.where(st.mask, 0.5 * (a + 1.0) * (st.q99 - st.q01 + 1e-8) + st.q01, a)   # mp _unnormalize_actions

    # ---- chunks -----------------------------------------------------------------------------------
    def encode_actions(self, actions: np.ndarray, key: Optional[str] = None) -> np.ndarray:
        """Raw action chunks ``[B, chunk, D]`` -> token ids ``[B, chunk * D]``."""
        a = np.asarray(actions)
        if a.shape[-2:] != (self.chunk_size, self.action_dim):
            raise ValueError(f"expected [..., {self.chunk_size}, {self.action_dim}] actions, got {a.shape}")
        return self.encode(self.normalize(a, key)).reshape(*a.shape[:-2], self.tokens_per_call)

    def decode_actions(self, tokens: np.ndarray, key: Optional[str] = None) -> np.ndarray:
        """Token ids ``[B, chunk * D]`` -> raw actions ``[B, chunk, D]`` (float32)."""
        t = np.asarray(tokens)
        if t.shape[-1] != self.tokens_per_call:
            raise ValueError(f"expected [..., {self.tokens_per_call}] tokens, got {t.shape}")
        a = self.decode(t).reshape(*t.shape[:-1], self.chunk_size, self.action_dim)
        return self.unnormalize(a, key).astype(np.float32)

    # ---- persistence ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"vocab_size": self.vocab_size, "num_bins": self.num_bins, "chunk_size": self.chunk_size,
                "action_dim": self.action_dim, "unnorm_key": self.unnorm_key,
                "stats": {k: v.to_dict() for k, v in self.stats.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "ActionTokenizer":
        return cls(vocab_size=d["vocab_size"], num_bins=d["num_bins"], chunk_size=d["chunk_size"],
                   action_dim=d["action_dim"], unnorm_key=d.get("unnorm_key"),
                   stats={k: ActionStats.from_dict(v) for k, v in d.get("stats", {}).items()})
