"""VLA policies behind one interface (docs/CONTRACTS.md): tiny OpenVLA-shaped model and real OpenVLA loaders."""

from async_vla.policy.build import build_policy, load_policy, save_policy
from async_vla.policy.interface import VLAPolicy, sample_tokens

__all__ = ["VLAPolicy", "build_policy", "load_policy", "sample_tokens", "save_policy"]
