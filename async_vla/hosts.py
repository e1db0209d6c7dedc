"""Host addresses and ports shared by the config checks, the weight path, the learner and the launchers (no torch,
no zmq)."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: an interface no other machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; another process may take it before it is bound again)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])
