"""Policy benchmark: ``act()`` latency and action tokens/s on CPU (both decodings, batch 1 / 8 / 64), the
learner's ``token_logprobs`` forward+backward, and built-in env steps/s on one core.

Run with ``bin/bench policy`` (or ``python -c "from benchmarks.policy import run; print(run())"``).
Figures are medians of repeated calls with one torch thread, measured in one run.
"""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks.common import md_table as _table, median_time


def _median_s(fn, repeats: int, warmup: int = 2) -> float:
    return median_time(fn, repeats=repeats, warmup=warmup)


def env_steps_per_s(seconds: float = 2.0) -> dict:
    """Built-in env steps/s on one core: random actions (render included) and the scripted expert."""
    from async_vla.envs.builtin import TASKS, TabletopEnv
    from async_vla.envs.expert import ScriptedExpert

    env = TabletopEnv()
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, size=(4096, 7))
    n, episodes, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        env.reset(episodes % len(TASKS), episodes)
        episodes += 1
        done = False
        while not done:
            _, done, _ = env.step(actions[n % len(actions)])
            n += 1
    random_rate = n / (time.perf_counter() - t0)
    expert = ScriptedExpert()
    n, episodes, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2:
        env.reset(episodes % len(TASKS), episodes)
        expert.reset(env)
        episodes += 1
        done = False
        while not done:
            _, done, _ = env.step(expert.act(env))
            n += 1
    return {"random_steps_per_s": random_rate, "expert_steps_per_s": n / (time.perf_counter() - t0)}


def run(quick: bool = False) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from async_vla.config import load_config
    from async_vla.policy import build_policy

    torch.set_num_threads(1)
    batches = [1, 8] if quick else [1, 8, 64]
    rows, results = [], {"act": [], "learner": [], "threads": 1}
    instr = "put the blue block on the green pad"
    for decoding in ("parallel", "autoregressive"):
        policy = build_policy(load_config(None, [f"policy.decoding={decoding}"]))
        policy.eval()
        results["parameters"] = sum(p.numel() for p in policy.parameters())
        for b in batches:
            rng = np.random.default_rng(b)
            images = rng.integers(0, 256, size=(b, 32, 32, 3), dtype=np.uint8)
            proprio = rng.normal(size=(b, 8)).astype(np.float32)
            gen = torch.Generator().manual_seed(0)
            reps = 3 if (quick or (decoding == "autoregressive" and b == 64)) else 10
            sec = _median_s(lambda: policy.act(images, proprio, [instr] * b, 1.6, gen), reps)
            tok_s = b * policy.tokens_per_call / sec
            results["act"].append({"decoding": decoding, "batch": b, "latency_ms": sec * 1e3, "tokens_per_s": tok_s,
                                   "calls_per_s": b / sec})
            rows.append([decoding, b, sec * 1e3, tok_s, b / sec])
        # Learner side: token_logprobs forward + backward on 32 policy calls (e.g. 8 trajectories x 4 calls).
        b = 8 if quick else 32
        images = torch.randint(0, 256, (b, 32, 32, 3), dtype=torch.uint8)
        proprio = torch.randn(b, 8)
        tokens = torch.from_numpy(policy.act(images.numpy(), proprio.numpy(), [instr] * b, 1.6)[0])

        def fwd_bwd():
            policy.zero_grad(set_to_none=True)
            policy.token_logprobs(images, proprio, [instr] * b, tokens, 1.6).mean().backward()

        sec = _median_s(fwd_bwd, 3 if quick else 5, warmup=1)
        results["learner"].append({"decoding": decoding, "calls": b, "fwd_bwd_ms": sec * 1e3})
    env_rates = env_steps_per_s(1.0 if quick else 3.0)
    results["env"] = env_rates
    md = _table(["decoding", "batch", "act ms", "tokens/s", "calls/s"], rows)
    md += "\n\n" + _table(["decoding", "learner calls", "token_logprobs fwd+bwd ms"],
                          [[r["decoding"], r["calls"], r["fwd_bwd_ms"]] for r in results["learner"]])
    md += (f"\n\nTiny policy: {results['parameters'] / 1e6:.2f} M parameters, 1 torch thread, 32x32 images, "
           f"56 tokens per call (T = 1.6).\nBuilt-in env, one core: {env_rates['random_steps_per_s']:.0f} steps/s "
           f"(random actions, rendering included), {env_rates['expert_steps_per_s']:.0f} steps/s with the "
           f"scripted expert.")
    return {"section": "policy", "results": results, "markdown": md}
