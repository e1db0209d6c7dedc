"""actor.backend=vllm (actors/vllm_backend.py, vllm_weights.py, vllm_worker_ext.py).

On CPU (no vLLM): the modules import without vLLM; the OpenVLA name map (ours -> HF/vLLM names) and its errors;
the update set (trainable engine tensors only) and its bucket layout; the worker extension receiving the same
bucketed stream as the torch actors (over gloo here, NCCL on GPU) with its version guard; ``VLLMPolicy`` driven
by a stand-in engine that follows vLLM's contract (prompt embeds in, allowed ids only, processed log-probs, an HF
Llama with "dummy" random weights that the backend must overwrite): behaviour log-probs equal the learner's
recomputation, versions land on trajectories, stale/duplicate versions are refused; config-time checks.

Marked ``gpu`` (vLLM + CUDA; written, never run here): the same against a real engine with ``load_format="dummy"``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from actors.vllm_backend import VLLMPolicy
from actors.vllm_weights import (
    LM_PREFIX, NameMap, StaleWeights, VersionGuard, WeightMappingError, engine_update, openvla_name_map,
)
from actors.vllm_worker_ext import VLAWorkerExtension
from async_vla.config import ConfigError, PolicyConfig, load_config
from async_vla.messages import PolicyTag

REPO = Path(__file__).resolve().parent.parent
INSTR = "pick up the red block"


# ------------------------------------------------------------------------------------------ tiny OpenVLA
class PatchEncoder(nn.Module):
    """[B, 3, H, W] -> [B, patches, 16], the shape Prismatic's vision backbones return."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 8, stride=8)

    def forward(self, pixels):
        return self.conv(pixels).flatten(2).transpose(1, 2)


class TinyPrismatic(nn.Module):
    """Prismatic's layout: vision_backbone -> projector -> patches inserted after BOS -> language_model."""

    def __init__(self, hidden: int, layers: int, heads: int):
        from transformers import LlamaConfig, LlamaForCausalLM

        super().__init__()
        self.vision_backbone = PatchEncoder()
        self.projector = nn.Sequential(nn.Linear(16, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.language_model = LlamaForCausalLM(LlamaConfig(
            vocab_size=32000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=256,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
        self.norm_stats = {"builtin": {"action": {"q01": [-1.0] * 7, "q99": [1.0] * 7, "mask": [True] * 6 + [False]}}}

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, pixel_values=None, use_cache=False, past_key_values=None):
        embeds = self.get_input_embeddings()(input_ids)
        if past_key_values is None:
            patches = self.projector(self.vision_backbone(pixel_values))
            embeds = torch.cat([embeds[:, :1], patches, embeds[:, 1:]], dim=1)
        return self.language_model(inputs_embeds=embeds, past_key_values=past_key_values, use_cache=use_cache)


def _tokenize(text, return_tensors="pt"):
    ids = [1] + [3 + zlib.crc32(w.encode()) % 29000 for w in text.split()]
    return SimpleNamespace(input_ids=torch.tensor([ids]))


def _image_processor(images, return_tensors="pt"):
    arr = np.stack([np.asarray(im, dtype=np.float32) / 255.0 for im in images])
    return {"pixel_values": torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()}


def make_policy(seed=0, hidden=64, layers=2, heads=2, device="cpu", dtype=torch.float32):
    from async_vla.policy.openvla_loader import OpenVLAPolicy

    torch.manual_seed(seed)
    model = TinyPrismatic(hidden, layers, heads).to(device, dtype).eval()
    pcfg = PolicyConfig(arch="openvla", path="unused", chunk_size=1, decoding="autoregressive")
    return OpenVLAPolicy(model, SimpleNamespace(tokenizer=_tokenize, image_processor=_image_processor), pcfg)


def observations(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), np.zeros((n, 8), np.float32), [INSTR] * n


# ------------------------------------------------------------------------------------------ CPU stand-ins
class DummyLM(nn.Module):
    """vLLM's model as the worker extension sees it: ``load_weights`` by HF name (KeyError for an unknown one)."""

    def __init__(self, config):
        from transformers import LlamaForCausalLM

        super().__init__()
        torch.manual_seed(1234)   # load_format="dummy": random weights unrelated to the policy's
        self.hf = LlamaForCausalLM(config).eval()

    def load_weights(self, weights):
        params, loaded = dict(self.hf.named_parameters()), set()
        for name, t in weights:
            params[name].data.copy_(t)
            loaded.add(name)
        return loaded


class FakeWorker(VLAWorkerExtension):
    def __init__(self, config):
        self.model_runner = SimpleNamespace(model=DummyLM(config))
        self.device = torch.device("cpu")

    def lm_state(self):
        return {n: p.detach().clone() for n, p in self.model_runner.model.hf.named_parameters()}


class FakeEngine:
    """vLLM's contract on CPU: prompt embeds in; ``max_tokens`` ids out, allowed ids only; log-probs after the
    allowed-id mask and the temperature (greedy at T = 1); RPCs go to the worker extension."""

    def __init__(self, policy):
        self.worker = FakeWorker(policy.inner.model.language_model.config)
        self.allowed = torch.tensor(policy.allowed_ids)
        self.calls = []

    def call(self, method, *args):
        self.calls.append(method)
        return getattr(self.worker, method)(*args)

    @torch.no_grad()
    def generate(self, prompt_embeds, temperature, max_tokens, seeds):
        lm = self.worker.model_runner.model.hf
        ids, logps = [], []
        for row, e in enumerate(prompt_embeds):
            gen = torch.Generator().manual_seed(seeds[row] if seeds else 0)
            x, past, toks, lps = e.unsqueeze(0), None, [], []
            for _ in range(max_tokens):
                out = lm(inputs_embeds=x, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logp = torch.log_softmax(out.logits[0, -1, self.allowed].float() / (temperature or 1.0), -1)
                j = int(logp.argmax()) if temperature == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
                toks.append(int(self.allowed[j]))
                lps.append(float(logp[j]))
                x = lm.get_input_embeddings()(torch.tensor([[toks[-1]]]))
            ids.append(toks)
            logps.append(lps)
        return ids, logps


# ------------------------------------------------------------------------------------------ CPU tests
def test_backend_modules_import_without_vllm():
    code = ("import sys, actors.actor, actors.vllm_backend, actors.vllm_weights, actors.vllm_worker_ext; "
            "assert 'vllm' not in sys.modules, 'vllm imported eagerly'")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_openvla_name_map_and_its_errors():
    policy = make_policy()
    m = openvla_name_map(policy)
    q = LM_PREFIX + "model.layers.0.self_attn.q_proj.weight"
    embed = LM_PREFIX + "model.embed_tokens.weight"
    assert m.engine_name(q) == "model.layers.0.self_attn.q_proj.weight" and not m.on_torch_side(q)
    assert m.engine_name(LM_PREFIX + "lm_head.weight") == "lm_head.weight"
    assert m.engine_name("model.projector.0.weight") is None and m.on_torch_side("model.projector.0.weight")
    assert m.engine_name(embed) == "model.embed_tokens.weight" and m.on_torch_side(embed)   # both sides
    lm_specs = {n: tuple(p.shape) for n, p in policy.named_parameters() if n.startswith(LM_PREFIX)}
    assert len({m.engine_name(n) for n in lm_specs}) == len(lm_specs) == len(m.targets)
    m.check(lm_specs, full=True)   # every LM parameter has its engine twin of the same shape
    with pytest.raises(WeightMappingError, match=r"unmapped.*layers\.9"):
        m.check({LM_PREFIX + "model.layers.9.mlp.up_proj.weight": (128, 64)})
    with pytest.raises(WeightMappingError, match=r"shape mismatch.*q_proj.*\(3, 3\)"):
        m.check({q: (3, 3)})
    with pytest.raises(WeightMappingError, match=r"missing \(1\).*lm_head"):
        m.check({k: v for k, v in lm_specs.items() if "lm_head" not in k}, full=True)
    with pytest.raises(WeightMappingError, match="no rule maps it"):
        m.check({"model.projector.0.weight": (64, 16)}, engine_only=True)
    assert NameMap.from_doc(json.loads(json.dumps(m.to_doc()))) == m   # travels to the worker as plain data


def test_update_set_is_trainable_engine_tensors_in_one_bucket_stream():
    from async_vla.weights.packer import pack

    policy = make_policy()
    frozen = LM_PREFIX + "model.norm.weight"
    dict(policy.named_parameters())[frozen].requires_grad_(False)
    m = openvla_name_map(policy)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    state = {n: p.detach().clone() for n, p in policy.named_parameters()}
    update = engine_update(state, m, trainable)
    assert set(update) == {n for n in trainable if n.startswith(LM_PREFIX)} and frozen not in update
    assert not any(n.startswith(("model.vision_backbone", "model.projector")) for n in update)
    cap = 1 << 16
    layout, buckets = pack(update, cap)
    assert [s.name for s in layout.specs] == list(update)                       # manifest in update order
    assert all(b.nbytes <= cap or any(e.bucket == i and e.spec.nbytes == b.nbytes for e in layout.entries)
               for i, b in enumerate(layout.buckets))                           # over the cap only when alone
    with pytest.raises(WeightMappingError, match=r"lacks trainable.*lm_head"):
        engine_update({k: v for k, v in state.items() if "lm_head" not in k}, m, trainable)


def test_version_guard():
    g = VersionGuard()
    g.commit(-1)
    g.commit(3)
    with pytest.raises(StaleWeights, match="duplicate weights v3"):
        g.check(3)
    with pytest.raises(StaleWeights, match="stale weights v2: v3 is installed"):
        g.commit(2)
    assert g.current == 3
    g.commit(4, lineage="a")                     # the first learner's stream
    g.commit(2, lineage="b")                     # a resumed learner restarts lower: another lineage starts afresh
    assert (g.current, g.lineage) == (2, "b")
    with pytest.raises(StaleWeights, match="stale weights v1: v2 is installed"):
        g.commit(1, lineage="b")
    with pytest.raises(StaleWeights, match="duplicate weights v2"):
        g.check(2)                               # None = the installed lineage
    g.commit(3)
    assert (g.current, g.lineage) == (3, "b")


def _load(worker, version, named, full=False):
    """One version into the worker extension; returns its result or the exception it raised."""
    try:
        return worker.vla_load_tensors(version, named, full)
    except Exception as exc:  # noqa: BLE001 - handed to the test
        return exc


def test_worker_extension_installs_versions_and_guards_them():
    policy = make_policy()
    m = openvla_name_map(policy)
    worker = FakeWorker(policy.model.language_model.config)
    worker.vla_setup(m.to_doc())
    lm = {n: p.detach().clone() for n, p in policy.named_parameters() if n.startswith(LM_PREFIX)}
    r = _load(worker, 3, lm, full=True)
    assert r["installed"] and r["version"] == 3 and r["tensors"] == len(lm), r
    got = worker.lm_state()
    assert all(torch.equal(got[m.engine_name(n)], t) for n, t in lm.items())   # dummy weights replaced
    assert worker.vla_weights_version() == 3

    bumped = {n: t + 1.0 for n, t in lm.items()}
    for stale in (3, 2):   # duplicate and stale: refused, nothing changes
        assert isinstance(_load(worker, stale, bumped), StaleWeights)
    assert all(torch.equal(worker.lm_state()[m.engine_name(n)], t) for n, t in lm.items())

    q = LM_PREFIX + "model.layers.0.self_attn.q_proj.weight"
    r = _load(worker, 4, {q: torch.zeros(3, 3)})                                 # wrong shape: refused
    assert isinstance(r, WeightMappingError) and "shape mismatch" in str(r), r
    r = _load(worker, 4, {"model.projector.0.weight": torch.zeros(64, 16)})      # not an engine tensor
    assert isinstance(r, WeightMappingError) and "no rule" in str(r), r
    assert worker.vla_weights_version() == 3

    r = _load(worker, 4, {q: bumped[q]})                                         # a partial (trainable) update
    assert r["installed"] and worker.vla_weights_version() == 4
    assert torch.equal(worker.lm_state()[m.engine_name(q)], bumped[q])


def test_vllm_policy_logprobs_equal_learner_recomputation():
    policy = make_policy()
    vp = VLLMPolicy(policy, FakeEngine)
    assert vp.engine.calls == ["vla_setup", "vla_load_tensors"] and vp.version == -1
    images, proprio, instr = observations(3)
    for temperature in (1.6, 0.0):
        tokens, logp = vp.act(images, proprio, instr, temperature, torch.Generator().manual_seed(0))
        assert tokens.dtype == np.int64 and logp.dtype == np.float32 and tokens.shape == logp.shape == (3, 7)
        assert ((tokens >= 31744) & (tokens < 32000)).all()
        with torch.no_grad():
            ref = policy.token_logprobs(images, proprio, instr, torch.as_tensor(tokens), temperature)
        np.testing.assert_allclose(logp, ref.numpy(), atol=1e-4)
    # greedy tokens are the argmax of the learner's teacher-forced logits
    idx = torch.as_tensor(tokens) - 31744
    with torch.no_grad():
        assert torch.equal(policy.action_logits(images, proprio, instr, idx).argmax(-1), idx)


def test_vllm_policy_versions_on_trajectories_and_stale_refused():
    from actors.actor import SerialActor
    from async_vla.envs import make_env

    cfg = load_config(None, ["actor.group_size=2", "env.envs_per_actor=2", "env.max_steps=3", "run.name=vl",
                             "buffer.dynamic_sampling=false"])
    policy = make_policy()
    vp = VLLMPolicy(policy, FakeEngine)
    learner = make_policy(seed=1)   # the learner's weights, version 5
    new = {n: p.detach().clone() for n, p in learner.named_parameters()}
    actor = SerialActor(cfg, 0, vp, [make_env(cfg, i) for i in range(2)], tag=PolicyTag("a", 0))
    actor.set_weights(PolicyTag("a", 5), new)
    assert actor.version == vp.version == vp.engine.worker.vla_weights_version() == 5
    trajs = actor.run_one_group("vl-g1")
    assert len(trajs) == 2
    for t in trajs:
        assert t.chunk_versions.tolist() == [5] * t.num_calls and t.behaviour_version == 5
        with torch.no_grad():
            ref = learner.token_logprobs(t.images, t.proprio, [t.instruction] * t.num_calls,
                                         torch.as_tensor(t.action_tokens), cfg.actor.temperature)
        np.testing.assert_allclose(t.behav_logprobs, ref.numpy(), atol=1e-4)

    old = {n: t - 1.0 for n, t in new.items()}
    for stale in (4, 5):   # refused: the actor keeps v5, neither side of the policy moves
        actor.set_weights(PolicyTag("a", stale), old)
        assert actor.version == vp.version == vp.engine.worker.vla_weights_version() == 5
    assert all(torch.equal(p, new[n]) for n, p in policy.named_parameters())
    with pytest.raises(WeightMappingError, match="missing"):   # a broken update is an error, not a swap
        actor.set_weights(PolicyTag("a", 6), {n: t for n, t in new.items() if not n.startswith("model.projector")})
    assert actor.version == vp.version == 5
    # The learner was resumed from an older checkpoint: the subscriber hands over its v3 tagged with the resumed
    # learner's lineage; the guard takes it on both sides, and orders versions within that lineage from then on.
    actor.set_weights(PolicyTag("b", 3), old)
    assert actor.version == vp.version == vp.engine.worker.vla_weights_version() == 3
    assert all(torch.equal(p, old[n]) for n, p in policy.named_parameters())
    actor.set_weights(PolicyTag("b", 2), new)
    assert actor.version == vp.version == vp.engine.worker.vla_weights_version() == 3
    actor.set_weights(PolicyTag("b", 4), new)
    assert actor.version == vp.version == vp.engine.worker.vla_weights_version() == 4


def test_config_checks_for_the_vllm_backend(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match="policy.arch=openvla"):    # the tiny arch is not a plain causal LM
        load_config(None, ["actor.backend=vllm", "policy.decoding=autoregressive"])
    cfg = load_config(None, ["actor.backend=vllm", "policy.decoding=autoregressive", "policy.arch=openvla",
                             "policy.path=/nonexistent", "policy.chunk_size=1"])
    assert cfg.actor.backend == "vllm" and 0 < cfg.actor.vllm_gpu_memory_utilization <= 1


def test_actor_policy_factory_routes_to_the_vllm_backend():
    from actors.actor import default_policy_factory

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm installed: the gpu tests cover the real path")
    cfg = load_config(None, [])
    cfg.actor.backend = "vllm"    # bypasses the config-time check on purpose: the factory must refuse too
    with pytest.raises(ValueError, match="policy.arch=openvla"):
        default_policy_factory(cfg)
    cfg.policy.arch = "openvla"
    with pytest.raises(ImportError, match=r"pip install -e '\.\[gpu\]'"):
        default_policy_factory(cfg)


# ------------------------------------------------------------------------------------------ GPU (real vLLM)
@pytest.fixture(scope="module")
def gpu_policy():
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from actors.vllm_backend import VLLMEngine

    policy = make_policy(hidden=256, layers=2, heads=4, device="cuda", dtype=torch.bfloat16)
    vp = VLLMPolicy(policy, lambda p: VLLMEngine(p.inner.model.language_model, p.allowed_ids,
                                                 gpu_memory_utilization=0.3, enforce_eager=True))
    yield policy, vp
    vp.engine.close()


@pytest.mark.gpu
def test_gpu_vllm_logits_and_logprobs_match_torch(gpu_policy):
    policy, vp = gpu_policy
    images, proprio, instr = observations(4)
    first, temperature = vp.tokenizer.first_action_id, 1.6
    # All 256 processed log-probs at every step = log_softmax(torch action logits / T), teacher-forced on vLLM's tokens.
    params = vp.engine.sampling_params(temperature, vp.tokens_per_call, seed=0, logprobs=256)
    outs = vp.engine.llm.generate([{"prompt_embeds": e} for e in vp.prompt_embeds(images, instr)],
                                  [params] * len(instr), use_tqdm=False)
    for row, out in enumerate(outs):
        c = out.outputs[0]
        idx = torch.tensor(c.token_ids, device="cuda") - first
        with torch.no_grad():
            logits = policy.action_logits(images[row:row + 1], proprio[row:row + 1], instr[:1], idx[None])
        ref = torch.log_softmax(logits.float() / temperature, -1)[0].cpu()
        got = torch.full_like(ref, float("-inf"))
        for i, step in enumerate(c.logprobs):
            for tok, lp in step.items():
                got[i, tok - first] = lp.logprob
        torch.testing.assert_close(got, ref, atol=5e-2, rtol=0)
    tokens, logp = vp.act(images, proprio, instr, temperature, torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        ref = policy.token_logprobs(images, proprio, instr, torch.as_tensor(tokens), temperature)
    np.testing.assert_allclose(logp, ref.float().cpu().numpy(), atol=5e-2)


@pytest.mark.gpu
def test_gpu_weights_pushed_from_a_learner(gpu_policy):
    policy, vp = gpu_policy
    learner = make_policy(seed=1, hidden=256, layers=2, heads=4, device="cuda", dtype=torch.bfloat16)
    state = {n: p.detach().clone() for n, p in learner.named_parameters()}
    vp.install_weights(state, PolicyTag("a", 1))
    assert vp.engine.call("vla_weights_version") == 1
    images, proprio, instr = observations(4, seed=1)
    tokens, logp = vp.act(images, proprio, instr, 1.6, torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        ref = learner.token_logprobs(images, proprio, instr, torch.as_tensor(tokens), 1.6)
    np.testing.assert_allclose(logp, ref.float().cpu().numpy(), atol=5e-2)
    for stale in (1, 0):
        with pytest.raises(StaleWeights):
            vp.install_weights(state, PolicyTag("a", stale))
    assert vp.engine.call("vla_weights_version") == 1
