"""Each env family's episode length in env steps when ``env.max_steps`` is not set: read by the envs and by the
config's size checks (async_vla/config, which must not import the envs). Imports nothing."""

# Built-in tabletop: two calls at the default 8-step chunks (the expert needs <= 3 steps); the quickstart sets 8.
BUILTIN_MAX_STEPS = 16
# LIBERO: the limits of OpenVLA-OFT's evaluation (longest demo + margin per suite). SimpleVLA-RL runs 512 steps in
# every suite (rob_rollout.py): configs/libero_*.yaml set env.max_steps=512.
LIBERO_MAX_STEPS = {"spatial": 220, "object": 280, "goal": 300, "10": 520, "90": 400}
