"""A tiny stand-in for a Prismatic OpenVLA(-OFT) model and its processor, for ``OpenVLAPolicy`` tests.

No checkpoint can be downloaded here, and Prismatic's modeling code ships only with a checkpoint, so this is
not its architecture: it is its *forward contract* on a tiny random ``LlamaForCausalLM`` - what
``async_vla.policy.openvla_loader`` relies on:
- ``forward(input_ids, attention_mask, pixel_values, past_key_values, use_cache)`` returning ``.logits`` over
  the padded 32064-row vocabulary and ``.past_key_values``;
- the image's patch embeddings inserted right after BOS on the first pass (so every text position sits behind
  them), later passes extending the KV cache one token at a time;
- OFT: ``action_positions`` learned action queries appended after the prompt, whose logits come last;
- ``norm_stats`` (q01 / q99 / mask per dataset key) on the model.
The processor has the two members the loader uses: ``tokenizer(text, return_tensors="pt").input_ids`` (BOS,
then hashed words below the action-token range) and ``image_processor(pil_images, return_tensors="pt")``.
"""

from __future__ import annotations

import inspect
import zlib
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

VOCAB = 32064       # OpenVLA's padded LM head (the last 64 rows are never action tokens)
BOS = 1


class StandInTokenizer:
    def __call__(self, text: str, return_tensors: str = "pt") -> SimpleNamespace:
        ids = [BOS] + [2 + zlib.crc32(w.encode()) % 29000 for w in text.split()]
        return SimpleNamespace(input_ids=torch.tensor([ids]))


class StandInImageProcessor:
    def __call__(self, images, return_tensors: str = "pt") -> dict:
        arr = np.stack([np.asarray(im, dtype=np.float32) / 127.5 - 1.0 for im in images])
        return {"pixel_values": torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()}


def standin_processor() -> SimpleNamespace:
    return SimpleNamespace(tokenizer=StandInTokenizer(), image_processor=StandInImageProcessor())


class StandInPrismatic(torch.nn.Module):
    def __init__(self, action_positions: int = 0, patch: int = 8, hidden: int = 32, seed: int = 0,
                 norm_stats: Optional[dict] = None):
        from transformers import LlamaConfig, LlamaForCausalLM

        super().__init__()
        torch.manual_seed(seed)
        self.llm = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256))
        self.patch = patch
        self.proj = torch.nn.Linear(3 * patch * patch, hidden)
        self.queries = (torch.nn.Parameter(0.02 * torch.randn(action_positions, hidden)) if action_positions
                        else None)
        self.norm_stats = norm_stats or {}

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                pixel_values: Optional[torch.Tensor] = None, past_key_values=None, use_cache: bool = False):
        emb = self.llm.get_input_embeddings()(input_ids)
        if pixel_values is not None:     # first pass: [BOS, image patches, the rest of the prompt(, queries)]
            patches = F.unfold(pixel_values, self.patch, stride=self.patch).transpose(1, 2)
            emb = torch.cat([emb[:, :1], self.proj(patches), emb[:, 1:]], dim=1)
            if self.queries is not None:
                emb = torch.cat([emb, self.queries.expand(emb.shape[0], -1, -1)], dim=1)
        # (transformers >= 5.24 names the cache argument ``cache``; Prismatic's own forward keeps the old name)
        cache_arg = "cache" if "cache" in inspect.signature(self.llm.forward).parameters else "past_key_values"
        return self.llm(inputs_embeds=emb, use_cache=use_cache, **{cache_arg: past_key_values})


# ---------------------------------------------------------------------------- as a checkpoint directory on disk
WORDS = ("in what action should the robot take to out pick up put place push open close turn on off it and of "
         "black bowl plate drawer top middle bottom cabinet stove ketchup basket").split()


def write_standin_checkpoint(path, oft: bool = False, norm_stats: Optional[dict] = None, image_size: int = 16,
                             seed: int = 0) -> None:
    """A directory ``load_openvla_policy`` loads as it loads a real OpenVLA(-OFT) checkpoint: config.json with an
    ``auto_map`` to remote code saved beside it (tests/standin_vla_remote.py), safetensors weights, and an
    ``AutoProcessor`` (a fast word-level tokenizer with BOS, and a SigLIP image processor)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from tests import standin_vla_remote as remote

    auto_model = "AutoModelForVision2Seq" if hasattr(transformers, "AutoModelForVision2Seq") else \
        "AutoModelForImageTextToText"
    remote.StandInVLAConfig.register_for_auto_class()
    remote.StandInVLAForActionPrediction.register_for_auto_class(auto_model)
    remote.StandInVLAProcessor.register_for_auto_class("AutoProcessor")
    torch.manual_seed(seed)
    cfg = remote.StandInVLAConfig(action_positions=56 if oft else 0, norm_stats=norm_stats or {})
    remote.StandInVLAForActionPrediction(cfg).save_pretrained(path)

    vocab = {"[UNK]": 0, "<s>": BOS, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="[UNK]")
    image_cls = getattr(transformers, "SiglipImageProcessorPil", None) or transformers.SiglipImageProcessor
    images = image_cls(size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    remote.StandInVLAProcessor(images, tokenizer).save_pretrained(path)
