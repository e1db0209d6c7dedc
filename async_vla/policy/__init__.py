"""VLA policies behind one interface (docs/CONTRACTS.md): tiny OpenVLA-shaped model and real OpenVLA loaders."""

from async_vla.policy.interface import VLAPolicy, build_policy, load_policy, sample_tokens, save_policy

__all__ = ["VLAPolicy", "build_policy", "load_policy", "sample_tokens", "save_policy"]
