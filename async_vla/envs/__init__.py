"""Simulators behind one interface (docs/CONTRACTS.md): ``base.make_env(cfg, seed)`` builds the built-in
tabletop family (``builtin``, numpy-rendered, no assets) or LIBERO (``libero``, optional extra)."""
