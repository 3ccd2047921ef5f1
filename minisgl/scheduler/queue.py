"""The waiting queue: one class per schedule policy.

Retracted requests resume before any new one (they hold tokens already streamed to a client and
the prefix cache may still hold their pages), the most urgent first; new requests follow in the
order of the policy.

Fairness: within one priority level, new requests are taken round-robin over their groups (the
requests of one client call: its n choices, its prompts; `SchedReq.group`), the group served
longest ago first (a group never served, in order of arrival), FIFO inside a group. So a client
that sent n=64 does not hold a later client's single request behind all 64: the newcomer is the
next request considered. Priority comes first: a more urgent level is always emptied before a
less urgent one is considered.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Deque, Dict, Iterator, List

from minisgl.scheduler.request import SchedReq, Status

SCAN_LIMIT = 1024  # waiting requests a pick looks at (a bound on the host time of one admission)


def urgency(req: SchedReq) -> tuple[int, int]:
    """Sort key: the most urgent first (priority, then admission order; priority is 0 under FCFS)."""
    return (req.sampling_params.priority, req.admit_seq)


def retraction_order(req: SchedReq, group_rows: Dict[int, int]) -> tuple[int, int, int]:
    """Sort key of decoders, the first to retract last: the least urgent priority, then (fairness)
    the group holding the most rows, then the latest admitted, so a request that came after an
    n=64 group is not the first to go for having come last."""
    return (req.sampling_params.priority, group_rows.get(req.group, 0), req.admit_seq)


class WaitQueue:
    """First come, first served."""

    def __init__(self) -> None:
        self._retracted: List[SchedReq] = []  # sorted by urgency
        self._new: Deque[SchedReq] = deque()
        self._served: Dict[int, int] = {}  # group -> when (pop count) it last had a request taken
        self._pops = 0

    def push(self, req: SchedReq) -> None:
        """A new request."""
        self._new.append(req)

    def requeue(self, req: SchedReq) -> None:
        """A retracted request: before every new one, among the retracted by urgency."""
        assert req.status is Status.RETRACTED
        self._retracted.append(req)
        self._retracted.sort(key=urgency)

    def peek(self) -> SchedReq | None:
        if self._retracted:
            return self._retracted[0]
        return self._next_new()

    def pop(self) -> SchedReq:
        """Take what `peek` returned."""
        if self._retracted:
            return self._retracted.pop(0)
        req = self._next_new()
        assert req is not None
        self._new.remove(req)
        self._pops += 1
        self._served[req.group] = self._pops
        if len(self._served) > 4 * len(self._new) + 64:  # forget groups long gone
            waiting = {r.group for r in self._new}
            self._served = {g: t for g, t in self._served.items() if g in waiting}
        return req

    def _next_new(self) -> SchedReq | None:
        """Round-robin over groups within the most urgent priority level: the first waiting
        request of the group served longest ago (never served: -1, the earliest to arrive)."""
        new = self._new
        if not new:
            return None
        head = new[0]
        if len(new) == 1:
            return head
        level = head.sampling_params.priority  # (the queue is ordered by priority)
        served = self._served
        best, best_t = head, served.get(head.group, -1)
        seen = {head.group}
        for req in islice(new, SCAN_LIMIT):
            if best_t < 0 or req.sampling_params.priority != level:
                break  # nobody beats a group never served; a less urgent level waits
            if req.group in seen:
                continue
            seen.add(req.group)
            t = served.get(req.group, -1)
            if t < best_t:
                best, best_t = req, t
        return best

    def remove(self, req: SchedReq) -> None:
        if req.status is Status.RETRACTED:
            self._retracted.remove(req)
        else:
            self._new.remove(req)

    @property
    def retracted(self) -> List[SchedReq]:
        return list(self._retracted)

    @property
    def num_retracted(self) -> int:
        return len(self._retracted)

    def __iter__(self) -> Iterator[SchedReq]:
        yield from self._retracted
        yield from self._new

    def __len__(self) -> int:
        return len(self._retracted) + len(self._new)

    def __bool__(self) -> bool:
        return bool(self._retracted or self._new)


class PriorityQueue(WaitQueue):
    """SamplingParams.priority first (lower first), FIFO among equals."""

    def push(self, req: SchedReq) -> None:
        new, priority = self._new, req.sampling_params.priority
        if new and new[-1].sampling_params.priority > priority:
            # before the first waiting request that is less urgent
            at = next(i for i, w in enumerate(new) if w.sampling_params.priority > priority)
            new.insert(at, req)
        else:
            new.append(req)


def make_queue(schedule_policy: str) -> WaitQueue:
    return {"fcfs": WaitQueue, "priority": PriorityQueue}[schedule_policy]()
