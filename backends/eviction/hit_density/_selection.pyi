from collections.abc import Callable

from kvkit.backends.eviction.hit_density import HitDensityPolicy
from kvkit.interfaces.types import BlockId

def select_rounds(policy: HitDensityPolicy, n: int, evictable: Callable[[int], bool], chosen: dict[int, None],
                  verified: bool) -> list[BlockId] | None: ...
