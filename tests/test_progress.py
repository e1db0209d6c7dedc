"""async_vla.progress: a live bar on a terminal, nothing in a log by default, plain lines at a bounded rate when
asked (ASYNC_VLA_PROGRESS); driven by a fake clock and a fake stream."""

import io

import pytest

from async_vla.progress import ENV_VAR, LINE_INTERVAL_S, Progress, format_duration


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(stream, clock, steps, dt, **kw):
    with Progress("[sft] training", steps, "epochs", stream=stream, clock=clock, **kw) as bar:
        for k in range(1, steps + 1):
            clock.now += dt
            bar.update(k, f"loss {1.0 / k:.2f}")


def test_a_terminal_gets_a_live_bar_with_an_eta_that_is_erased_at_the_end(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    stream, clock = Stream(tty=True), Clock()
    run(stream, clock, 4, 30.0)
    out = stream.getvalue()
    assert "\n" not in out   # redrawn in place, never a line of its own
    frames = [f for f in out.split("\r") if f.startswith("[")]
    assert frames[0] == "[#####...............] [sft] training: 1/4 epochs, loss 1.00, 30s elapsed, ETA 1m30s\x1b[K"
    assert frames[-1].startswith("[####################] [sft] training: 4/4 epochs, loss 0.25, 2m00s elapsed")
    assert "ETA" not in frames[-1]
    assert out.endswith("\r\x1b[K")   # erased: the caller's result lines follow on a clean line


def test_a_bar_redraws_at_a_bounded_rate_and_clear_makes_room_for_other_output(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    stream, clock = Stream(tty=True), Clock()
    bar = Progress("[eval] eval", 1000, "episodes", stream=stream, clock=clock)
    for k in range(1, 1000):
        clock.now += 0.001   # 1000 updates within a second: a handful of redraws
        bar.update(k)
    assert 1 < stream.getvalue().count("\r[") <= 6
    bar.clear()
    assert stream.getvalue().endswith("\r\x1b[K")
    stream.truncate(0), stream.seek(0)
    bar.clear()   # nothing live: nothing written
    assert stream.getvalue() == ""
    bar.update(1000)   # drawn again after a clear, and the finished state always
    assert "1000/1000 episodes" in stream.getvalue()


def test_a_log_file_gets_nothing_by_default_and_lines_only_when_asked(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    stream, clock = Stream(tty=False), Clock()
    run(stream, clock, 5, 60.0)
    assert stream.getvalue() == ""

    monkeypatch.setenv(ENV_VAR, "lines:0")   # a line at every update, no carriage returns
    stream = Stream(tty=False)
    run(stream, clock, 3, 2.0)
    assert stream.getvalue().splitlines() == [
        "[sft] training: 1/3 epochs, loss 1.00, 2s elapsed, ETA 4s",
        "[sft] training: 2/3 epochs, loss 0.50, 4s elapsed, ETA 2s",
        "[sft] training: 3/3 epochs, loss 0.33, 6s elapsed"]
    assert "\r" not in stream.getvalue()

    monkeypatch.setenv(ENV_VAR, "lines")   # at most one line per LINE_INTERVAL_S, and the last
    stream = Stream(tty=True)
    run(stream, clock, 20, LINE_INTERVAL_S / 4)
    lines = stream.getvalue().splitlines()
    assert [line.split(":")[1].split(",")[0] for line in lines] == [" 4/20 epochs", " 8/20 epochs", " 12/20 epochs",
                                                                    " 16/20 epochs", " 20/20 epochs"]


def test_off_a_missing_label_and_bad_settings(monkeypatch):
    stream, clock = Stream(tty=True), Clock()
    monkeypatch.setenv(ENV_VAR, "off")
    run(stream, clock, 3, 1.0)
    monkeypatch.setenv(ENV_VAR, "bar")
    with Progress(None, 3, stream=stream, clock=clock) as bar:   # no label: the library default, silent
        bar.update()
    assert stream.getvalue() == ""
    forced = Stream(tty=False)
    run(forced, clock, 2, 1.0)   # bar: even where the stream is not a terminal
    assert "\r[##########..........] [sft] training: 1/2 epochs" in forced.getvalue()
    for bad in ("sometimes", "lines:-1", "lines:soon"):
        monkeypatch.setenv(ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"{ENV_VAR}=.*lines:SECONDS"):
            Progress("x", 3, stream=stream, clock=clock)


def test_durations_read_as_a_person_would_write_them():
    assert [format_duration(s) for s in (0, 42.4, 60, 365, 3599, 3720)] == ["0s", "42s", "1m00s", "6m05s",
                                                                             "59m59s", "1h02m"]
