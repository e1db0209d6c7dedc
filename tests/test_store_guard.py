"""The weight-rendezvous store's guard (async_vla/weights/store_guard.py): beyond loopback only listed peers reach
the TCPStore; everyone else is disconnected before a byte is relayed. The machine's own non-loopback address stands
in for a remote peer (the guard judges the source address the kernel reports)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import TCPStore

from async_vla.config import load_config
from async_vla.weights.store_guard import StoreGuard


def _own_address() -> str:
    """A non-loopback IPv4 address of this machine (a UDP connect picks the outgoing interface, sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        return s.getsockname()[0]


def test_guard_relays_listed_peers_and_refuses_the_rest():
    try:
        addr = _own_address()
    except OSError:
        pytest.skip("no non-loopback interface")
    if addr.startswith("127."):
        pytest.skip("no non-loopback interface")
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    open_guard = StoreGuard(addr, 0, store.port, allowed=[f"{addr}/32"])
    other = "203.0.113.7" if not addr.startswith("203.0.113.") else "198.51.100.7"   # documentation addresses
    closed_guard = StoreGuard(addr, 0, store.port, allowed=[f"{other}/32"])
    try:
        store.set("w/session", "abc")
        client = TCPStore(addr, open_guard.port, None, False, timedelta(seconds=10), wait_for_workers=False)
        assert client.get("w/session") == b"abc"              # relayed both ways
        client.set("w/from-client", "1")
        assert store.get("w/from-client") == b"1"
        with socket.create_connection((addr, closed_guard.port), timeout=5) as s:   # refused: closed at once
            s.settimeout(5)
            assert s.recv(1) == b""
        assert closed_guard.refused[addr] == 1 and closed_guard.relayed == 0 and open_guard.relayed >= 1
        assert not open_guard.is_allowed(other) and open_guard.is_allowed("127.0.0.1")
    finally:
        open_guard.close()
        closed_guard.close()


def test_config_needs_an_allow_list_beyond_loopback(tmp_path):
    from async_vla.config import ConfigError

    with pytest.raises(ConfigError, match="weights_allowed_peers"):
        load_config(None, ["transport.host=0.0.0.0", "transport.curve=true", f"transport.curve_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="not an address or network"):
        load_config(None, ["transport.host=0.0.0.0", "transport.curve=true", f"transport.curve_dir={tmp_path}",
                           "transport.weights_allowed_peers=[nonsense]"])
    cfg = load_config(None, ["transport.host=0.0.0.0", "transport.curve=true", f"transport.curve_dir={tmp_path}",
                             "transport.weights_allowed_peers=[10.0.0.0/24]"])
    assert cfg.transport.weights_allowed_peers == ["10.0.0.0/24"]
