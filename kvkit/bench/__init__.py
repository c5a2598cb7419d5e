"""The library half of ``kvkit bench``: copy-backend throughput and shared-store throughput.

:mod:`kvkit.bench.transfer` times copy backends on registered KV tensors
(``kvkit bench transfer``); :mod:`kvkit.bench.shared` times a block store
against the server's own benchmark tool (``kvkit bench shared``).
"""
