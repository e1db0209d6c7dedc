"""Orchestration: serial mode and the one-host multi-process launcher (imports actors/ and learner/).

Only ``bin/`` scripts call into this package; it is where processes are started."""
