from array import array

import numpy as np

from kvkit.backends.eviction.hit_density.density import HitDensityModel

def read(where: bytearray, classes: bytearray, lasts: array, ghost_live: bytearray, ghost_classes: bytearray,
          ghost_lasts: array, clock: int, turn: int, limit: int, model: HitDensityModel,
          out: np.ndarray) -> np.ndarray | None: ...
