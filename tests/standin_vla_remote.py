"""Remote code of a tiny stand-in OpenVLA checkpoint directory (written by tests/openvla_standin.py).

``save_pretrained`` copies this file into the checkpoint, and ``from_pretrained(..., trust_remote_code=True)``
imports it from there, as transformers does with Prismatic's ``modeling_prismatic.py``: so it must stay
self-contained (torch and transformers only). The model follows Prismatic's forward contract, not its
architecture (see tests/openvla_standin.py).
"""

import inspect
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel, ProcessorMixin


class StandInVLAConfig(PretrainedConfig):
    model_type = "standin_vla"

    def __init__(self, hidden_size: int = 32, patch: int = 8, action_positions: int = 0,
                 norm_stats: Optional[dict] = None, vocab_size: int = 32064, **kwargs):
        self.hidden_size, self.patch, self.action_positions = hidden_size, patch, action_positions
        self.norm_stats = norm_stats or {}
        self.vocab_size = vocab_size
        super().__init__(**kwargs)


class StandInVLAForActionPrediction(PreTrainedModel):
    config_class = StandInVLAConfig
    base_model_prefix = "standin"

    def __init__(self, config: StandInVLAConfig):
        super().__init__(config)
        h = config.hidden_size
        self.llm = LlamaForCausalLM(LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256))
        self.proj = torch.nn.Linear(3 * config.patch * config.patch, h)
        self.queries = torch.nn.Parameter(0.02 * torch.randn(config.action_positions, h))
        self.norm_stats = config.norm_stats
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                pixel_values: Optional[torch.Tensor] = None, past_key_values=None, use_cache: bool = False,
                **kwargs):
        emb = self.llm.get_input_embeddings()(input_ids)
        if pixel_values is not None:     # first pass: [BOS, image patches, the rest of the prompt(, queries)]
            p = self.config.patch
            patches = F.unfold(pixel_values, p, stride=p).transpose(1, 2)
            emb = torch.cat([emb[:, :1], self.proj(patches), emb[:, 1:]], dim=1)
            if self.config.action_positions:
                emb = torch.cat([emb, self.queries.expand(emb.shape[0], -1, -1)], dim=1)
        new_api = "cache" in inspect.signature(self.llm.forward).parameters     # transformers >= 5.24
        out = self.llm(inputs_embeds=emb, use_cache=use_cache, **{"cache" if new_api else "past_key_values":
                                                                   past_key_values})
        # Prismatic returns its own output type with ``past_key_values`` (a ModelOutput with that field cannot be
        # made on transformers 5.24, which renames it ``cache``; DeepSpeed warns that it cannot see into this one)
        return SimpleNamespace(logits=out.logits, past_key_values=out.cache if new_api else out.past_key_values)


class StandInVLAProcessor(ProcessorMixin):
    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        super().__init__(image_processor, tokenizer, **kwargs)
