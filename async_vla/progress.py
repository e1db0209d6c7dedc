"""Progress of a long step (SFT epochs, demo collection, evaluation episodes): ``what: k/n unit, elapsed, ETA``, on
stderr. ``ASYNC_VLA_PROGRESS`` (README): ``auto`` (default: a live bar on a terminal, nothing otherwise),
``lines`` / ``lines:S`` (a plain line at most every ``LINE_INTERVAL_S`` / S seconds, plus the last), ``bar``,
``off``. Output of its own while a bar is live goes after ``clear()``."""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional, TextIO

ENV_VAR = "ASYNC_VLA_PROGRESS"
BAR_INTERVAL_S = 0.2
LINE_INTERVAL_S = 10.0
BAR_WIDTH = 20


def parse_mode(value: str) -> tuple[str, float]:
    """``ASYNC_VLA_PROGRESS`` -> (mode, line interval in seconds); a clear error for anything else."""
    value = value.strip().lower() or "auto"
    if value in ("auto", "bar", "off", "lines"):
        return value, LINE_INTERVAL_S
    if value.startswith("lines:"):
        try:
            interval = float(value[len("lines:"):])
        except ValueError:
            interval = -1.0
        if interval >= 0:
            return "lines", interval
    raise ValueError(f"{ENV_VAR}={value!r}: use auto (a bar on a terminal, else nothing), lines, lines:SECONDS "
                     f"(plain lines at most that often), bar or off")


def format_duration(seconds: float) -> str:
    """``42s``, ``6m05s``, ``1h02m``."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """``total`` steps of ``what`` (``unit`` names them): ``update(done, info)`` after each, ``close()`` (or the
    ``with`` block's end) at the end. ``mode`` None reads ``ASYNC_VLA_PROGRESS``; ``what`` None reports nothing."""

    def __init__(self, what: Optional[str], total: int, unit: str = "", *, stream: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic, mode: Optional[str] = None):
        self.what, self.total, self.unit = what or "", max(0, int(total)), unit
        self.stream = sys.stderr if stream is None else stream
        self.clock = clock
        mode, self.line_interval = parse_mode(os.environ.get(ENV_VAR, "auto") if mode is None else mode)
        if what is None:
            mode = "off"
        elif mode == "auto":
            isatty = getattr(self.stream, "isatty", None)
            mode = "bar" if isatty is not None and isatty() else "off"
        self.mode = mode
        self.done = 0
        self.info = ""
        self.start = self.last_shown = clock()
        self.live = False   # a bar is on the screen

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def text(self) -> str:
        """``what: k/n unit, info, 1m05s elapsed, ETA 2m10s`` (ETA once a step is done)."""
        elapsed = self.clock() - self.start
        parts = [f"{self.what}: {self.done}/{self.total}" + (f" {self.unit}" if self.unit else "")]
        if self.info:
            parts.append(self.info)
        parts.append(f"{format_duration(elapsed)} elapsed")
        if 0 < self.done < self.total:
            parts.append(f"ETA {format_duration(elapsed / self.done * (self.total - self.done))}")
        return ", ".join(parts)

    def update(self, done: Optional[int] = None, info: str = "") -> None:
        """``done`` steps finished so far (default: one more); ``info`` is shown after the count (a loss)."""
        self.done = self.done + 1 if done is None else int(done)
        self.info = info
        if self.mode == "off":
            return
        now = self.clock()
        finished = self.done >= self.total
        if self.mode == "lines":
            if finished or now - self.last_shown >= self.line_interval:
                self.stream.write(self.text() + "\n")
                self.stream.flush()
                self.last_shown = now
            return
        if finished or not self.live or now - self.last_shown >= BAR_INTERVAL_S:
            filled = BAR_WIDTH * min(self.done, self.total) // max(1, self.total)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            self.stream.write(f"\r[{bar}] {self.text()}\x1b[K")
            self.stream.flush()
            self.live, self.last_shown = True, now

    def clear(self) -> None:
        """Erase a live bar (before other output); the next ``update`` draws it again. Lines stay."""
        if self.live:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.live = False

    def close(self) -> None:
        """The step has ended: a live bar is erased (the caller's result lines follow)."""
        self.clear()
