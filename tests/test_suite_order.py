"""bin/test's file order (tests/conftest.py): files with `slow` tests go to the xdist workers first, the longest
declared timeout ahead, and every file's tests stay together and in their order."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

_spec = importlib.util.spec_from_file_location("suite_conftest", Path(__file__).with_name("conftest.py"))
suite_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite_conftest)


def _item(path, name, slow=False, timeout=None):
    marks = {}
    if slow:
        marks["slow"] = pytest.mark.slow.mark
    if timeout is not None:
        marks["timeout"] = pytest.mark.timeout(timeout).mark
    return SimpleNamespace(path=Path(path), name=name, get_closest_marker=marks.get)


def test_long_files_go_first_and_each_file_stays_together_in_order():
    config = SimpleNamespace(getini=lambda key: "300")
    items = [_item("a.py", "a1"), _item("a.py", "a2"),
             _item("b.py", "b1", slow=True), _item("b.py", "b2"),                     # slow at the default bound
             _item("c.py", "c1"), _item("c.py", "c2", slow=True, timeout=1500),     # the longest bound
             _item("d.py", "d1", timeout=900),                                     # a bound but not slow: short
             _item("e.py", "e1", slow=True, timeout=900)]
    suite_conftest._longest_files_first(config, items)
    assert [i.name for i in items] == ["c1", "c2", "e1", "b1", "b2", "a1", "a2", "d1"]


def test_without_pytest_timeout_slow_files_still_go_first():
    def no_ini(key):
        raise ValueError(f"unknown configuration value: {key!r}")
    items = [_item("a.py", "a1"), _item("b.py", "b1", slow=True), _item("a.py", "a2")]
    suite_conftest._longest_files_first(SimpleNamespace(getini=no_ini), items)
    assert [i.name for i in items] == ["b1", "a1", "a2"]
