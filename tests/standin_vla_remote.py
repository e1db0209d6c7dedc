"""Remote code of a tiny stand-in OpenVLA(-OFT) checkpoint directory (written by tests/openvla_standin.py).

``save_pretrained`` copies this file into the checkpoint, and ``from_pretrained(..., trust_remote_code=True)``
imports it from there, as transformers does with Prismatic's ``modeling_prismatic.py``: so it must stay
self-contained (torch and transformers only). It follows the published module layout (``vision_backbone``,
``projector``, ``language_model``) and forward contracts, not the architecture (tiny random layers):

- OpenVLA (``StandInVLAForActionPrediction``): ``forward(input_ids, attention_mask, pixel_values, labels,
  past_key_values, use_cache)`` -> ``.logits`` over the padded 32064-row vocabulary and ``.past_key_values``; the
  image's patch embeddings go right after BOS on the first pass, later passes extend the KV cache one token at a time.
- OpenVLA-OFT as SimpleVLA-RL's ``modeling_prismatic.py`` ``forward`` (``StandInOFTForActionPrediction``, written
  from its description): no labels; append ``ACTION_DIM x NUM_ACTIONS_CHUNK`` placeholder tokens (id 1) and a stop
  token (id 2) to the prompt, zero the placeholders' embeddings, insert the patches after BOS, run the language
  model with the 2D attention mask, and return the logits tensor ``[B, ACTION_DIM x NUM_ACTIONS_CHUNK, vocab]``
  sliced from position ``num_patches + (prompt length - 1)``. The language model is stock transformers Llama, i.e.
  causal unless the loader makes it bidirectional as OFT's transformers fork does.
- OpenVLA-OFT as openvla-oft's own ``modeling_prismatic.py`` (``StandInOFTLabelsForActionPrediction``): the forward
  takes input ids that already end in the placeholders and the stop token, finds the placeholders from ``labels``
  (``ACTION_TOKEN_BEGIN_IDX`` < label; it fails without labels, as upstream's ``get_current_action_mask(None)``
  does), passes the labels on to the language model and returns ``.logits`` of the whole multimodal sequence; the
  model's ``_prepare_input_for_action_prediction`` / ``_prepare_labels_for_action_prediction`` build those inputs,
  and ``IGNORE_INDEX`` is a module constant, as there.
- ``NUM_ACTIONS_CHUNK`` / ``ACTION_DIM`` are module globals fixed at import from ``ROBOT_PLATFORM``, falling back
  to ALOHA (25 x 14) as SimpleVLA-RL's ``constants.py`` does: the trap a loader must not fall into.
"""

import inspect
import os
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel, ProcessorMixin

_PLATFORMS = {"LIBERO": (8, 7), "ALOHA": (25, 14), "BRIDGE": (5, 7)}
ROBOT_PLATFORM = os.environ.get("ROBOT_PLATFORM", "").upper() or "ALOHA"
NUM_ACTIONS_CHUNK, ACTION_DIM = _PLATFORMS.get(ROBOT_PLATFORM, _PLATFORMS["ALOHA"])
PLACEHOLDER_ID, STOP_INDEX = 1, 2
IGNORE_INDEX, ACTION_TOKEN_BEGIN_IDX = -100, 31743


class StandInVLAConfig(PretrainedConfig):
    model_type = "standin_vla"

    def __init__(self, hidden_size: int = 32, patch: int = 8, action_positions: int = 0,
                 norm_stats: Optional[dict] = None, vocab_size: int = 32064, **kwargs):
        self.hidden_size, self.patch, self.action_positions = hidden_size, patch, action_positions
        self.norm_stats = norm_stats or {}
        self.vocab_size = vocab_size
        super().__init__(**kwargs)


class PatchEncoder(torch.nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.patch = patch
        self.proj = torch.nn.Linear(3 * patch * patch, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(F.unfold(pixel_values, self.patch, stride=self.patch).transpose(1, 2))


class StandInVLAForActionPrediction(PreTrainedModel):
    config_class = StandInVLAConfig
    base_model_prefix = "standin"

    def __init__(self, config: StandInVLAConfig):
        super().__init__(config)
        h = config.hidden_size
        self.vision_backbone = PatchEncoder(config.patch, h)
        self.projector = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.GELU(), torch.nn.Linear(h, h))
        self.language_model = LlamaForCausalLM(LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512))
        self.norm_stats = config.norm_stats
        self.post_init()

    @property
    def _supports_sdpa(self) -> bool:
        # As Prismatic's modeling_prismatic.py: asks the language model, which transformers' PreTrainedModel.__init__
        # wants to know before this __init__ has built it (so the model must be built with eager attention)
        return self.language_model._supports_sdpa

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                pixel_values: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                past_key_values=None, use_cache: bool = False, **kwargs):
        emb = self.get_input_embeddings()(input_ids)
        if pixel_values is not None:     # first pass: [BOS, image patches, the rest of the prompt]
            patches = self.projector(self.vision_backbone(pixel_values))
            emb = torch.cat([emb[:, :1], patches, emb[:, 1:]], dim=1)
        new_api = "cache" in inspect.signature(self.language_model.forward).parameters     # transformers >= 5.24
        out = self.language_model(inputs_embeds=emb, use_cache=use_cache,
                                  **{"cache" if new_api else "past_key_values": past_key_values})
        # Prismatic returns its own output type with ``past_key_values`` (a ModelOutput with that field cannot be
        # made on transformers 5.24, which renames it ``cache``; DeepSpeed warns that it cannot see into this one)
        return SimpleNamespace(logits=out.logits, past_key_values=out.cache if new_api else out.past_key_values)

    def _with_placeholders(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """The prompt with the platform's placeholders and the stop token appended, and its attention mask."""
        b, n_act = input_ids.shape[0], ACTION_DIM * NUM_ACTIONS_CHUNK    # the module's import-time constants
        ids = torch.cat([input_ids, torch.full((b, n_act), PLACEHOLDER_ID, dtype=input_ids.dtype,
                                               device=input_ids.device),
                         torch.full((b, 1), STOP_INDEX, dtype=input_ids.dtype, device=input_ids.device)], dim=1)
        mask = torch.cat([attention_mask, torch.ones(b, n_act + 1, dtype=attention_mask.dtype,
                                                     device=attention_mask.device)], dim=1)
        return ids, mask

    def _multimodal(self, ids: torch.Tensor, mask: torch.Tensor, is_action: torch.Tensor,
                    pixel_values: torch.Tensor, labels: Optional[torch.Tensor] = None):
        """The language model over [BOS, patches, the rest] with the placeholders' embeddings zeroed, and the number
        of patches."""
        b = ids.shape[0]
        emb = self.get_input_embeddings()(ids) * ~is_action.unsqueeze(-1)   # the stop's embedding is kept
        patches = self.projector(self.vision_backbone(pixel_values))
        mm = torch.cat([emb[:, :1], patches, emb[:, 1:]], dim=1)
        mm_mask = torch.cat([mask[:, :1], torch.ones(b, patches.shape[1], dtype=mask.dtype, device=mask.device),
                             mask[:, 1:]], dim=1)
        mm_labels = None
        if labels is not None:
            mm_labels = torch.cat([labels[:, :1], torch.full((b, patches.shape[1]), IGNORE_INDEX, dtype=labels.dtype,
                                                             device=labels.device), labels[:, 1:]], dim=1)
        out = self.language_model(inputs_embeds=mm, attention_mask=mm_mask, labels=mm_labels, use_cache=False)
        return out, patches.shape[1]


class StandInOFTForActionPrediction(StandInVLAForActionPrediction):
    """SimpleVLA-RL's OFT forward: no labels, returns the action positions' logits."""

    def forward(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, proprio=None, **kwargs) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        n_act = ACTION_DIM * NUM_ACTIONS_CHUNK
        num_prompt_tokens = input_ids.shape[-1] - 1
        ids, mask = self._with_placeholders(input_ids, attention_mask)
        is_action = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        is_action[:, -n_act - 1:-1] = True
        out, num_patches = self._multimodal(ids, mask, is_action, pixel_values)
        start = num_patches + num_prompt_tokens
        return out.logits[:, start:start + n_act]


class StandInOFTLabelsForActionPrediction(StandInVLAForActionPrediction):
    """openvla-oft's OFT forward: the placeholders come marked by ``labels``; returns the whole sequence's logits."""

    def _prepare_input_for_action_prediction(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        return self._with_placeholders(input_ids, attention_mask)

    def _prepare_labels_for_action_prediction(self, labels: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ext = torch.full((labels.shape[0], input_ids.shape[-1] - labels.shape[-1]), ACTION_TOKEN_BEGIN_IDX + 1,
                         dtype=labels.dtype, device=labels.device)
        labels = torch.cat([labels, ext], dim=-1)
        labels[:, -1] = STOP_INDEX
        return labels

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                pixel_values: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                past_key_values=None, use_cache: bool = False, **kwargs):
        is_action = labels > ACTION_TOKEN_BEGIN_IDX          # TypeError without labels, as upstream fails there
        out, _ = self._multimodal(input_ids, attention_mask, is_action, pixel_values, labels)
        return SimpleNamespace(logits=out.logits, loss=out.loss)


class StandInVLAProcessor(ProcessorMixin):
    # As PrismaticProcessor declares them: transformers 4.x (the gpu extra's pin) needs the names, 5.x infers them.
    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        super().__init__(image_processor, tokenizer, **kwargs)
