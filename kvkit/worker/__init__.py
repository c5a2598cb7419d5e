"""The worker side of an offload tier: KV tensors, their layouts, and the transfer engine."""

WAIT_TIMEOUT_S = 60.0
"""Default bound, in seconds, of a worker's waits (``TransferEngine.drain`` and ``close``).

Here, not in ``engine.py``, so the configuration reads it without importing torch.
"""
