"""What layer-wise loads cost and what they buy: one plan loaded whole, then stage by stage, per backend.

For each copy backend that runs here, a load of ``--blocks`` blocks of
Llama-3-8B shapes (32 layers, 8 KV heads, head size 128, bf16, 16-token blocks:
2 MiB a block) goes through the :class:`~kvkit.TransferEngine` whole, then
layered with 1 and 4 layers a stage. Each mode reports, as medians over
``--repeats`` runs in one process:

* ``submit_ms``: host time inside ``submit`` (the cost of per-stage launches and events);
* ``first_layer_ms``: from ``submit`` until layer 0 is readable on the compute
  stream (``wait_layer(0)``, then an event on the compute stream completes);
* ``total_ms`` and ``gbps``: until the whole plan is confirmed (``drain``);
* ``gbps_vs_whole``: the layered plan's bandwidth over the whole plan's, same backend.

    python benchmarks/bench_layered.py [--blocks 1024] [--repeats 5] \
        [--backends torch,cuda-dma,cupy-batch,auto] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvkit import COPY, KVCacheSpec, TransferEngine, TransferPlan

SPEC = KVCacheSpec(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
MODES = (("whole", None), ("layered-1", 1), ("layered-4", 4))


def _one(engine: TransferEngine, plan: TransferPlan, layered: bool) -> tuple[float, float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.submit(0, plan, layered=layered)
    t1 = time.perf_counter()
    engine.wait_layer(0)
    ready = torch.cuda.Event()
    ready.record()
    ready.synchronize()
    t2 = time.perf_counter()
    engine.drain()
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3, (t3 - t0) * 1e3


def run(backend: str, blocks: int, repeats: int) -> list[dict]:
    rows = []
    ids = list(range(blocks))
    plan = TransferPlan(ids, ids, "load")
    for mode, per_stage in MODES:
        engine = TransferEngine(SPEC, COPY.create(backend), num_cpu_blocks=blocks, layers_per_stage=per_stage or 1)
        engine.allocate_kv(blocks, "per-layer", "cuda")
        _one(engine, plan, per_stage is not None)  # warm-up: kernels, pinned index buffers
        runs = [_one(engine, plan, per_stage is not None) for _ in range(repeats)]
        submit, first, total = (statistics.median(r[i] for r in runs) for i in range(3))
        rows.append({"backend": backend, "mode": mode, "submit_ms": round(submit, 3),
                     "first_layer_ms": round(first, 3), "total_ms": round(total, 3),
                     "gbps": round(blocks * SPEC.bytes_per_block / total / 1e6, 2)})
        engine.close()
    whole = rows[0]["gbps"]
    for row in rows:
        row["gbps_vs_whole"] = round(row["gbps"] / whole, 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="torch,cuda-dma,cupy-batch,auto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layered needs a CUDA GPU")
    rows = [row for b in args.backends.split(",") if COPY.available(b) for row in run(b, args.blocks, args.repeats)]
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "blocks": args.blocks, "rows": rows}, indent=1))
        return
    print(f"{torch.cuda.get_device_name()}: load of {args.blocks} blocks "
          f"({args.blocks * SPEC.bytes_per_block >> 20} MiB)")
    print(f"{'backend':<11}{'mode':<11}{'submit ms':>10}{'first layer ms':>16}{'total ms':>10}{'GB/s':>8}"
          f"{'vs whole':>10}")
    for r in rows:
        print(f"{r['backend']:<11}{r['mode']:<11}{r['submit_ms']:>10.3f}{r['first_layer_ms']:>16.3f}"
              f"{r['total_ms']:>10.3f}{r['gbps']:>8.2f}{r['gbps_vs_whole']:>10.3f}")


if __name__ == "__main__":
    main()
