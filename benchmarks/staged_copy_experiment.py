"""Experiment (GPU): staged copies for a per-layer GPU cache and a blocks-first CPU tier.

Per-layer GPU caches (vLLM's) cut a block into 64 pieces of 32 KiB (Llama-3-8B
shapes). Copied piece by piece in both directions at once, the copy engines move
only 46-65 GB/s in total. This experiment gathers a chunk of blocks on the GPU
into a staging buffer laid out like the CPU tier (each block's 64 pieces back to
back, 2 MiB), then moves whole blocks with kvkit's ``cuda-dma`` backend; loads
run the other way (DMA into staging, then a scatter). The gather and scatter are
plain torch ops on their own streams; staging slots are recycled through events.

Not a shipped backend: it needs the CPU tier in a different layout from the GPU
tier, which kvkit's stack does not offer yet. Every run checks three blocks of
each direction byte for byte (``ok``, absent with ``--dma-only``). Usage::

    python benchmarks/staged_copy_experiment.py [--blocks 1024] [--chunk 64] [--slots 3] [--dma-only]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from kvkit.backends.copy.cuda_dma import CudaDMACopy
from kvkit.interfaces.copy import Region
from kvkit.interfaces.types import Direction, TransferPlan

LAYERS, BLOCK, HEADS, DIM = 32, 16, 8, 128
PIECES = 2 * LAYERS
PIECE = BLOCK * HEADS * DIM  # bf16 elements of one piece


class Staged:
    """Stores and loads of whole blocks through ``slots`` staging chunks of ``chunk`` blocks."""

    def __init__(self, gpu: torch.Tensor, cpu: torch.Tensor, chunk: int, slots: int, dma_only: bool) -> None:
        self.gpu, self.chunk, self.slots, self.dma_only = gpu, chunk, slots, dma_only
        dev = gpu.device
        self.gathered = [torch.empty(PIECES, chunk, PIECE, device=dev, dtype=gpu.dtype) for _ in range(2)]
        self.out = torch.empty(slots * chunk, PIECES * PIECE, device=dev, dtype=gpu.dtype)
        self.into = torch.empty(slots * chunk, PIECES * PIECE, device=dev, dtype=gpu.dtype)
        self.dma = CudaDMACopy()
        self.dma.register([Region("out", self.out, cpu, 0), Region("in", self.into, cpu, 1)])
        self.kernels = [torch.cuda.Stream(dev) for _ in Direction]

    def _chunks(self, n: int):
        for k, start in enumerate(range(0, n, self.chunk)):
            size = min(self.chunk, n - start)
            slot = k % self.slots
            yield k, start, size, np.arange(slot * self.chunk, slot * self.chunk + size)

    def store(self, gpu_ids: torch.Tensor, cpu_ids: np.ndarray) -> None:
        """Enqueue GPU blocks ``gpu_ids`` (on the device) onto CPU blocks ``cpu_ids``."""
        free, stream = [None] * self.slots, self.kernels[0]
        for k, start, size, staging in self._chunks(len(cpu_ids)):
            with torch.cuda.stream(stream):
                if free[k % self.slots] is not None:
                    stream.wait_event(free[k % self.slots])
                if not self.dma_only:
                    picked = self.gathered[k % 2][:, :size]
                    torch.index_select(self.gpu, 1, gpu_ids[start:start + size], out=picked)
                    self.out[staging[0]:staging[-1] + 1].view(size, PIECES, PIECE).copy_(picked.transpose(0, 1))
                ready = torch.cuda.Event()
                ready.record(stream)
            self.dma.submit(TransferPlan(staging, cpu_ids[start:start + size], Direction.STORE, 0), after=ready)
            free[k % self.slots] = torch.cuda.Event()
            free[k % self.slots].record(self.dma.stream(Direction.STORE))

    def load(self, gpu_ids: torch.Tensor, cpu_ids: np.ndarray) -> None:
        """Enqueue CPU blocks ``cpu_ids`` onto GPU blocks ``gpu_ids`` (on the device)."""
        free, stream = [None] * self.slots, self.kernels[1]
        for k, start, size, staging in self._chunks(len(cpu_ids)):
            self.dma.submit(TransferPlan(cpu_ids[start:start + size], staging, Direction.LOAD, 1),
                            after=free[k % self.slots])
            arrived = torch.cuda.Event()
            arrived.record(self.dma.stream(Direction.LOAD))
            with torch.cuda.stream(stream):
                stream.wait_event(arrived)
                if not self.dma_only:
                    rows = self.into[staging[0]:staging[-1] + 1].view(size, PIECES, PIECE)
                    self.gpu.index_copy_(1, gpu_ids[start:start + size], rows.transpose(0, 1))
                free[k % self.slots] = torch.cuda.Event()
                free[k % self.slots].record(stream)


def median_seconds(run, repeat: int, staged: Staged) -> float:
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        staged.dma.poll()
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1024, help="blocks per direction")
    parser.add_argument("--chunk", type=int, default=64, help="blocks per staging chunk")
    parser.add_argument("--slots", type=int, default=3, help="staging chunks in flight per direction")
    parser.add_argument("--dma-only", action="store_true", help="skip gather and scatter (the DMA's own ceiling)")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gpu_blocks, cpu_blocks = 4 * args.blocks, 2 * args.blocks
    gpu = torch.randn(PIECES, gpu_blocks, PIECE, device=dev, dtype=torch.bfloat16)  # piece r of block b: gpu[r, b]
    cpu = torch.zeros(cpu_blocks, PIECES * PIECE, dtype=torch.bfloat16, pin_memory=True)
    staged = Staged(gpu, cpu, args.chunk, args.slots, args.dma_only)
    rng = np.random.default_rng(0)
    g_out, g_in = (torch.from_numpy(rng.permutation(gpu_blocks)[:args.blocks]).to(dev) for _ in range(2))
    c_out, c_in = (rng.permutation(cpu_blocks)[:args.blocks] for _ in range(2))
    nbytes = args.blocks * PIECES * PIECE * gpu.element_size()
    report = {k: v for k, v in vars(args).items() if k != "repeat"}
    for name, run, factor in (("d2h", lambda: staged.store(g_out, c_out), 1),
                              ("h2d", lambda: staged.load(g_in, c_in), 1),
                              ("both", lambda: (staged.store(g_out, c_out), staged.load(g_in, c_in)), 2)):
        report[f"{name}_gbps"] = round(factor * nbytes / median_seconds(run, args.repeat, staged) / 1e9, 1)
    if not args.dma_only:
        staged.store(g_out, c_out)
        staged.load(g_in, c_in)
        torch.cuda.synchronize()
        report["ok"] = all(torch.equal(cpu[c[i]].view(PIECES, PIECE).to(dev), gpu[:, g[i]])
                           for g, c in ((g_out, c_out), (g_in, c_in)) for i in (0, args.blocks // 2, -1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
