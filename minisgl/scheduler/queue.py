"""The waiting queue: one class per schedule policy.

Retracted requests resume before any new one (they hold tokens already streamed to a client and
the prefix cache may still hold their pages), the most urgent first; new requests follow in the
order of the policy.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Iterator, List

from minisgl.scheduler.request import SchedReq, Status


def urgency(req: SchedReq) -> tuple[int, int]:
    """Sort key: the most urgent first (priority, then admission order; priority is 0 under FCFS)."""
    return (req.sampling_params.priority, req.admit_seq)


class WaitQueue:
    """First come, first served."""

    def __init__(self) -> None:
        self._retracted: List[SchedReq] = []  # sorted by urgency
        self._new: Deque[SchedReq] = deque()

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
        return self._new[0] if self._new else None

    def pop(self) -> SchedReq:
        return self._retracted.pop(0) if self._retracted else self._new.popleft()

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
