"""A tiny stand-in for a Prismatic OpenVLA(-OFT) checkpoint and its processor, for ``OpenVLAPolicy`` tests.

No checkpoint can be downloaded here, and Prismatic's modeling code ships only with a checkpoint, so this is
not its architecture: it is its published module layout and *forward contract* (tests/standin_vla_remote.py,
the remote code a stand-in checkpoint directory ships): OpenVLA's KV-cache forward, and SimpleVLA-RL's OFT
forward (placeholders + stop token appended, placeholder embeddings zeroed, logits of chunk x dim positions
returned, constants fixed at import from ``ROBOT_PLATFORM`` with the ALOHA fallback), ``norm_stats`` on the
model, and on disk ``dataset_statistics.json`` beside the weights. The processor has the two members the loader
uses: ``tokenizer(text, return_tensors="pt").input_ids`` (BOS, then hashed words below the action-token range)
and ``image_processor(pil_images, return_tensors="pt")``.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

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


# The remote code's model class of each flavour (tests/standin_vla_remote.py): OpenVLA's autoregressive forward,
# SimpleVLA-RL's OFT forward (no labels), openvla-oft's OFT forward (labels mark the placeholders).
FLAVOURS = {"openvla": "StandInVLAForActionPrediction", "oft": "StandInOFTForActionPrediction",
            "oft_labels": "StandInOFTLabelsForActionPrediction"}


def StandInPrismatic(action_positions: int = 0, patch: int = 8, hidden: int = 32, seed: int = 0,
                     norm_stats: Optional[dict] = None, flavour: Optional[str] = None):
    """The remote code's model built in this process (no checkpoint directory). ``action_positions`` > 0 makes it
    OFT (SimpleVLA-RL's forward, which appends the platform's chunk x dim placeholders) unless ``flavour`` names
    one of ``FLAVOURS``."""
    from tests import standin_vla_remote as remote

    torch.manual_seed(seed)
    cls = getattr(remote, FLAVOURS[flavour or ("oft" if action_positions else "openvla")])
    return cls(remote.StandInVLAConfig(   # eager: as the loader builds Prismatic
        hidden_size=hidden, patch=patch, action_positions=action_positions, norm_stats=norm_stats or {},
        attn_implementation="eager"))


def set_platform_constants(name: str) -> None:
    """Give the in-process remote module the constants it would have read at import with ROBOT_PLATFORM=name
    (a checkpoint loaded through transformers imports its own copy, after the loader sets ROBOT_PLATFORM)."""
    from tests import standin_vla_remote as remote

    remote.NUM_ACTIONS_CHUNK, remote.ACTION_DIM = remote._PLATFORMS[name]


set_platform_constants("LIBERO")    # as if this process ran with ROBOT_PLATFORM=LIBERO (run_openvla_oft_rl_libero.sh)


# ---------------------------------------------------------------------------- as a checkpoint directory on disk
WORDS = ("in what action should the robot take to out pick up put place push open close turn on off it and of "
         "black bowl plate drawer top middle bottom cabinet stove ketchup basket").split()


def write_standin_checkpoint(path, oft: bool = False, norm_stats: Optional[dict] = None, image_size: int = 16,
                             seed: int = 0, dataset_statistics: Optional[dict] = None,
                             flavour: Optional[str] = None) -> None:
    """A directory ``load_openvla_policy`` loads as it loads a real OpenVLA(-OFT) checkpoint: config.json with an
    ``auto_map`` to remote code saved beside it (tests/standin_vla_remote.py; the model class of ``flavour``, by
    default SimpleVLA-RL's OFT forward when ``oft`` else OpenVLA's), safetensors weights, and an ``AutoProcessor`` (a
    fast word-level tokenizer with BOS, and a SigLIP image processor); with ``dataset_statistics`` also the
    ``dataset_statistics.json`` an OpenVLA-OFT SFT run writes beside the weights."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from tests import standin_vla_remote as remote

    auto_model = "AutoModelForVision2Seq" if hasattr(transformers, "AutoModelForVision2Seq") else \
        "AutoModelForImageTextToText"
    flavour = flavour or ("oft" if oft else "openvla")
    cls = getattr(remote, FLAVOURS[flavour])
    remote.StandInVLAConfig.register_for_auto_class()
    cls.register_for_auto_class(auto_model)
    remote.StandInVLAProcessor.register_for_auto_class("AutoProcessor")
    torch.manual_seed(seed)
    cfg = remote.StandInVLAConfig(action_positions=0 if flavour == "openvla" else 56, norm_stats=norm_stats or {},
                                  attn_implementation="eager")
    cls(cfg).save_pretrained(path)

    vocab = {"[UNK]": 0, "<s>": BOS, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="[UNK]")
    image_cls = getattr(transformers, "SiglipImageProcessorPil", None) or transformers.SiglipImageProcessor
    images = image_cls(size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    remote.StandInVLAProcessor(images, tokenizer).save_pretrained(path)
    if dataset_statistics is not None:
        (Path(path) / "dataset_statistics.json").write_text(json.dumps(dataset_statistics))
