"""Who the weight publisher's actors are: registrations (``w/tokens``, ``w/member/<token>``), heartbeats
(``w/hb/<token>``) and leaves (``w/leave/<token>``, ``w/leaves``), read from the learner's store. Liveness is "the
heartbeat moved within the stale window" on the publisher's own clock (no clocks compared across hosts)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field


@dataclass
class Member:
    actor_id: int
    hb: int = -1
    seen: float = field(default_factory=time.monotonic)
    fails: int = 0
    suspended_until: float = 0.0


class MemberRegistry:
    """The registered actors by token, updated from the store by ``live``."""

    def __init__(self):
        self.members: dict[int, Member] = {}
        self._known = 0            # tokens read so far
        self._missing: dict[int, float] = {}   # token -> when its info was first found missing
        self._leaves = 0           # the store's count of members that left, when we last looked

    def live(self, store, stale_s: float, missing_s: float) -> list[int]:
        """Tokens of the members heartbeating within ``stale_s`` and not suspended, sorted; one store round trip
        (``multi_get``) when nothing changed."""
        now = time.monotonic()
        toks = list(self.members)
        got = [int(x) for x in store.multi_get(["w/tokens", "w/leaves"] + [f"w/hb/{tok}" for tok in toks])]
        registered, leaves, beats = got[0], got[1], dict(zip(toks, got[2:]))
        while self._known < registered:
            tok = self._known + 1
            if not store.check([f"w/member/{tok}"]):
                # Registered a moment ago, info not written yet: look again next time - unless it has been
                # missing for long (the actor died in between), which must not block later tokens.
                first = self._missing.setdefault(tok, now)
                if now - first < missing_s:
                    break
                self._known = tok
                continue
            info = json.loads(store.get(f"w/member/{tok}"))
            self.members[tok] = Member(int(info.get("actor_id", -tok)))
            beats[tok] = store.add(f"w/hb/{tok}", 0)
            self._known = tok
        if leaves != self._leaves:      # someone left: find who (one store round trip per member, only now)
            self._leaves = leaves
            for tok in [t for t in self.members if store.check([f"w/leave/{t}"])]:
                del self.members[tok]
        newest: dict[int, int] = {}
        for tok, m in self.members.items():
            hb = beats[tok]
            if hb != m.hb:
                m.hb, m.seen = hb, now
            newest[m.actor_id] = max(tok, newest.get(m.actor_id, 0))
        # A newer registration of the same actor id (restart, reconnect) retires the older token for good;
        # a silent token is kept (cheap) because a stopped actor that resumes heartbeats on it again.
        for tok in [t for t, m in self.members.items() if newest[m.actor_id] != t]:
            del self.members[tok]
        return sorted(t for t, m in self.members.items() if now - m.seen <= stale_s and now >= m.suspended_until)
