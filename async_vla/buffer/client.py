"""The learner's client of the buffer: one rank's side of the batch channel (``BatchRequest`` -> this rank's
share of a batch), plus the buffer's stats (control channel) for a checkpoint. Torch-free, like the rest of the
package."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from async_vla.learner_secret import learner_secret, secret_path, sign
from async_vla.messages import BatchRequest, ControlCommand, Lineage
from async_vla.phases import PhaseClock
from async_vla.transport import ControlClient, ControlTimeout, CurveKeys, endpoints

log = logging.getLogger("learner")


class BatchClient:
    """One learner rank's requests for batches: one outstanding ``BatchRequest`` at a time.

    ``lineage``: this learner start's, the same on every rank (``Learner.start_lineage``); every request carries
    it, so the buffer tells a new learner from a retrying one and follows it (``GroupBuffer.set_learner_version``).
    ``phases``: the rank's PhaseClock, whose seconds every request carries to the buffer's stats (none: {})."""

    def __init__(self, cfg: Any, run_dir: Path, rank: int, world: int, *, lineage: Lineage,
                 phases: Optional[PhaseClock] = None):
        if not lineage.id:
            raise ValueError("BatchClient needs the learner's lineage (Learner.start_lineage), not the initial one")
        self.cfg, self.rank, self.world, self.lineage, self.phases = cfg, rank, world, lineage, phases
        eps = endpoints(cfg.transport, run_dir, side="connect")
        self.endpoint, self.control_endpoint = eps["batch"], eps["control"]
        self.keys = CurveKeys.load(cfg.transport.curve_dir, "client") if cfg.transport.curve else None
        self.secret = learner_secret(secret_path(cfg.transport, run_dir))
        self.client = self._connect()
        self.pending = False
        self.sent_at = 0.0
        self.reconnects = 0

    def _connect(self) -> ControlClient:
        ident = f"learner-{self.rank}-{os.getpid()}-{time.monotonic_ns()}".encode()
        return ControlClient(self.endpoint, identity=ident, keys=self.keys)

    def poll(self, version: int) -> Optional[list[list[Any]]]:
        """Ask for (or keep waiting on) this rank's share; a list of groups, or None if not ready yet."""
        timeout = self.cfg.learner.batch_timeout_s
        if not self.pending:
            try:
                self.client.request(sign(self.secret, BatchRequest(
                    rank=self.rank, world=self.world, version=version, timeout_s=timeout,
                    lineage=self.lineage.encode(), phases=self.phases.seconds() if self.phases is not None else {})),
                    timeout_s=timeout)
            except ControlTimeout as exc:  # never block in a send: the buffer is gone for long
                log.warning("%s: reconnecting", exc)
                self._reconnect()
                return None
            self.pending, self.sent_at = True, time.monotonic()
        bad_before = self.client.malformed.total
        got = self.client.recv_bundle(timeout_s=timeout + 0.5)
        if got is None:
            if self.client.malformed.total > bad_before:
                self.pending = False  # a reply we could not read (e.g. a refused request): ask again
            elif time.monotonic() - self.sent_at > timeout + self.cfg.learner.reply_grace_s:
                # No reply at all: the buffer restarted (our request died with it) or is gone.
                log.warning("no reply from the buffer at %s for %.0f s: reconnecting", self.endpoint,
                            time.monotonic() - self.sent_at)
                self._reconnect()
            return None
        self.pending = False
        header, members = got
        if not getattr(header, "ready", False):
            return None
        sizes = list(header.group_sizes)
        if sum(sizes) != len(members) or not sizes:
            log.warning("batch %s: %d members for group sizes %s: dropped", header.batch_id, len(members), sizes)
            return None
        groups, pos = [], 0
        for s in sizes:
            groups.append(members[pos:pos + s])
            pos += s
        return groups

    def _reconnect(self) -> None:
        """A fresh socket (new identity): any late reply to the old one is dropped, never mistaken for ours."""
        self.client.close()
        self.client = self._connect()
        self.pending = False
        self.reconnects += 1

    def buffer_stats(self, timeout_s: float = 2.0) -> dict:
        """The buffer's ledger and counters (for the checkpoint), {} if it does not answer."""
        client = ControlClient(self.control_endpoint, identity=f"learner-stats-{os.getpid()}".encode(), keys=self.keys)
        try:
            reply = client.call(ControlCommand("stats"), timeout_s=timeout_s)
            if getattr(reply, "command", "") == "stats" and isinstance(reply.value, str):
                return json.loads(reply.value)
        except (ValueError, json.JSONDecodeError, ControlTimeout):
            pass
        finally:
            client.close()
        return {}

    def close(self) -> None:
        self.client.close()
