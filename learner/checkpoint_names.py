"""Where a run's learner checkpoints are, without torch (the launchers, bin/train and the fault tools read it):
``<run>/checkpoints/v<version, 8 digits>/`` directories and a ``latest`` file naming the newest complete one."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional

LATEST_FILE = "latest"


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest ``v<version>`` checkpoint directories (never the latest)."""
    latest = (directory / LATEST_FILE).read_text().strip() if (directory / LATEST_FILE).is_file() else None
    tags = sorted((p for p in directory.glob("v*") if p.is_dir() and p.name[1:].isdigit()),
                  key=lambda p: int(p.name[1:]))
    for p in tags[:-keep] if keep > 0 else []:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)


def checkpoint_tag(version: int) -> str:
    """The directory name of the checkpoint of ``version``."""
    return f"v{version:08d}"


def latest_tag(directory: Path | str) -> Optional[str]:
    """The tag ``<directory>/latest`` names if that checkpoint exists; else the newest complete Torch checkpoint
    (``v<version>/learner.pt``, written via a rename); else None."""
    d = Path(directory)
    f = d / LATEST_FILE
    if f.is_file():
        tag = f.read_text().strip()
        if (d / tag).is_dir():
            return tag
    complete = sorted(p.name for p in d.glob("v*")
                      if re.fullmatch(r"v\d{8}", p.name) and (p / "learner.pt").is_file())
    return complete[-1] if complete else None


def latest_version(directory: Path | str) -> Optional[int]:
    """The version of ``latest_tag(directory)``; None when there is no checkpoint."""
    tag = latest_tag(directory)
    return int(tag[1:]) if tag is not None else None
