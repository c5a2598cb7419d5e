"""The whole state of the objects the twin and fault tests compare, as plain values.

Two objects driven alike (one running its compiled loops, one its Python references, or one whose loop
failed part way and one run on the blocks it finished) must give equal values here: every field, the
arrays byte for byte, and the order their blocks entered in.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvkit.backends.eviction._queue import ParkingQueue


def queue_state(queue: ParkingQueue) -> dict[str, Any]:
    """Every field of a parking queue and of its slots (arrays byte for byte), and its blocks in entry order."""
    state = {f.name: getattr(queue, f.name) for f in attrs.fields(ParkingQueue)
             if f.name not in ("_slots", "_back", "_owner", "_loops")}
    slots = queue._slots
    state["_back"] = (queue._back._chunks, queue._back._maxes)  # the side list chunk by chunk
    state["slots"] = (bytes(slots.prev), bytes(slots.next), bytes(slots.stamp), bytes(slots.state), slots.clock,
                      slots.queues)
    state["order"] = queue.in_order()
    return state
