"""The bounded-staleness rollout buffer between generators and the trainer (plain Python, no Ray).

Slots are counted in step batches (one optimizer step's rollouts). A slot is *reserved* when work
is handed to a generator and *filled* when its rollouts arrive, so `capacity` bounds the work in
flight plus the rollouts waiting: when every slot is taken, no more work is handed out and the
generators wait (backpressure). `take` hands the trainer batches in dispatch order (so what a
step trains on does not depend on which generator finished first), each only if its policy
version is at most `max_staleness` behind the trainer's; older ones are dropped, counted, and
their slots freed.

With `capacity = max_staleness + 1` and weight updates delivered in order before later work, a
dropped batch cannot happen: the batch trained at step t was dispatched after policy t - capacity
was pushed. The check still runs on every batch, so a broken delivery order shows up as drops.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass
class StepRollouts:
    """The rollouts of one step batch, as a generator returned them."""

    ticket: int  # dispatch order
    version: int  # policy version of the weights that sampled them
    payload: Any  # the rollout groups
    generate_s: float = 0.0  # the generator's time on this batch


class StalenessBuffer:
    """Step batches in dispatch order, handed out in that order and only while fresh enough."""

    def __init__(self, capacity: int, max_staleness: int):
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        if max_staleness < 0:
            raise ValueError(f"grpo.max_staleness must be >= 0, got {max_staleness}")
        self.capacity, self.max_staleness = capacity, max_staleness
        self.order: deque[int] = deque()  # tickets dispatched and not yet taken, oldest first
        self.ready: dict[int, StepRollouts] = {}
        self.dropped: list[tuple[int, int]] = []  # (ticket, version) of every dropped batch

    def free_slots(self) -> int:
        return self.capacity - len(self.order)

    def reserve(self, ticket: int) -> None:
        """Take a slot for work about to be dispatched; refuses when the buffer is full."""
        if self.free_slots() <= 0:
            raise RuntimeError(f"rollout buffer full ({self.capacity} slots): wait for the trainer to take a batch")
        if self.order and ticket <= self.order[-1]:
            raise ValueError(f"ticket {ticket} dispatched after ticket {self.order[-1]}: tickets must increase")
        self.order.append(ticket)

    def put(self, item: StepRollouts) -> None:
        """Fill the reserved slot of `item.ticket` with rollouts that arrived."""
        if item.ticket not in self.order or item.ticket in self.ready:
            raise RuntimeError(f"rollouts for ticket {item.ticket} arrived without a reserved slot")
        self.ready[item.ticket] = item

    def is_fresh(self, item: StepRollouts, trainer_version: int) -> bool:
        return trainer_version - item.version <= self.max_staleness

    def take(self, trainer_version: int) -> StepRollouts | None:
        """The oldest dispatched batch if it has arrived and is within `max_staleness` of `trainer_version`.

        Arrived batches too old are dropped (their slots free up) and the next one is tried;
        None while the oldest batch is still being generated.
        """
        while self.order and self.order[0] in self.ready:
            item = self.ready.pop(self.order.popleft())
            if item.version > trainer_version:
                raise RuntimeError(
                    f"rollouts of ticket {item.ticket} carry policy version {item.version}, newer than the "
                    f"trainer's {trainer_version}: versions are out of sync"
                )
            if self.is_fresh(item, trainer_version):
                return item
            self.dropped.append((item.ticket, item.version))
        return None
