"""tests/faults: reliability and security (issue 10). Slow tests drive a live local system (runner/faults/live.py)."""

import sys
from pathlib import Path

# The shared helpers of tests/ (test_buffer.make_traj, ...) import each other by bare module name.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
