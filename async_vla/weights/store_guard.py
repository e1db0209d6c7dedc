"""The weight store's door beyond loopback. TCPStore has no authentication, so the learner's store listens on
127.0.0.1; with ``transport.host`` beyond loopback a ``StoreGuard`` listens there, closes every connection from an
address outside ``transport.weights_allowed_peers`` (loopback always allowed; logged once per address) and relays
the others byte for byte. One thread, a selector."""

from __future__ import annotations

import collections
import ipaddress
import logging
import selectors
import socket
import threading
from typing import Iterable

from async_vla.hosts import is_loopback

log = logging.getLogger(__name__)

CHUNK = 1 << 16


def parse_peers(peers: Iterable[str]) -> list:
    """``ip`` or ``ip/prefix`` strings -> networks; ValueError naming the bad entry."""
    out = []
    for p in peers:
        try:
            out.append(ipaddress.ip_network(str(p).strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"transport.weights_allowed_peers: {p!r} is not an address or network ({exc})") from None
    return out


class StoreGuard:
    """Accept on (host, port); relay allowed peers to 127.0.0.1:``store_port``; refuse everyone else."""

    def __init__(self, host: str, port: int, store_port: int, allowed: Iterable[str]):
        self.allowed = parse_peers(allowed)
        self.store_port = int(store_port)
        self.refused: collections.Counter = collections.Counter()   # address -> connections closed at once
        self.relayed = 0
        self._listen = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind((host, int(port)))
        self._listen.listen(128)
        self._listen.setblocking(False)
        self.port = self._listen.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-guard", daemon=True)
        self._thread.start()

    def is_allowed(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%")[0])
        if getattr(ip, "ipv4_mapped", None) is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback or any(ip in net for net in self.allowed)

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.2):
                if key.data is None:
                    self._accept()
                else:
                    self._pump(key.fileobj, key.data)

    def _accept(self) -> None:
        try:
            conn, addr = self._listen.accept()
        except (BlockingIOError, OSError):
            return
        if not self.is_allowed(addr[0]):
            if not self.refused[addr[0]]:
                log.warning("weights: refused a store connection from %s (not in transport.weights_allowed_peers)",
                            addr[0])
            self.refused[addr[0]] += 1
            conn.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.store_port), timeout=5)
        except OSError as exc:
            log.warning("weights: store guard could not reach the store (%s)", exc)
            conn.close()
            return
        upstream.settimeout(None)
        conn.setblocking(True)
        self.relayed += 1
        self._sel.register(conn, selectors.EVENT_READ, upstream)
        self._sel.register(upstream, selectors.EVENT_READ, conn)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            data = src.recv(CHUNK)
            if data:
                dst.sendall(data)
                return
        except OSError:
            pass
        for s in (src, dst):      # one side closed (or failed): close the pair
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()
