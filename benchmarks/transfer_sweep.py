"""Sweep of copy-backend variants on Llama-3-8B shapes, one JSON file per section.

Usage: ``python benchmarks/transfer_sweep.py main --out DIR`` (per-layer layout,
GPU tier in one buffer). The first sweep (BENCHMARKS.md) also had sections for
cross-layer and for kernel variants since folded into the backends' defaults.
Each configuration is timed and checked by :func:`kvkit.bench.transfer.bench_backend`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from kvkit import COPY, KVCacheSpec
from kvkit.bench.transfer import GemmLoad, Rig, bench_backend, gemm_alone, make_plans, measure_ceiling

SPEC = KVCacheSpec(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")

VARIANTS = {
    "torch": lambda: COPY.create("torch"),
    "dma": lambda: COPY.create("cuda-dma"),
    "dma-nooverlap": lambda: COPY.create("cuda-dma", prefer_overlap=False),
    "dma2d": lambda: COPY.create("cuda-dma", strided=True),
    **{f"bulk{n}": (lambda n=n: COPY.create("cupy-batch", sm_budget=n)) for n in (1, 2, 3, 4, 8)},
    "bulk2-w12": lambda: COPY.create("cupy-batch", sm_budget=2, threads=384, stages=2),
    "bulk2-w6s4": lambda: COPY.create("cupy-batch", sm_budget=2, threads=192, stages=4),
    "bulk2-w4-16k": lambda: COPY.create("cupy-batch", sm_budget=2, threads=128, stages=3, stage_bytes=16 << 10),
    **{f"vec{n}": (lambda n=n: COPY.create("cupy-batch", sm_budget=n, method="vector"))
       for n in (1, 2, 4, 8, 16)},
    "auto": lambda: COPY.create("auto"),
    **{f"split-{s}": (lambda s=s: COPY.create("auto", kernel_share=s)) for s in (0.3, 0.5, 0.6)},
}

# (layout, alloc, [(blocks, ids, direction, gemm, variants)])
SECTIONS = {
    "main": ("per-layer", "buffer", [
        (256, "random", "store", True, ["bulk1", "bulk2", "bulk3", "bulk4", "bulk2-w12", "bulk2-w6s4", "bulk2-w4-16k",
                                     "vec2", "auto", "split-0.3", "split-0.5", "split-0.6"]),
        (256, "random", "load", True, ["bulk2", "bulk3", "bulk4", "dma", "auto"]),
        (16, "random", "store", False, ["bulk2", "bulk4", "dma", "auto"]),
        (16, "random", "load", False, ["bulk2", "bulk4", "dma", "auto"]),
        (256, "random", "both", False, ["auto", "bulk2", "bulk4", "dma", "split-0.5"]),
        (1024, "random", "store", False, ["bulk2", "vec2", "auto"]),
        (1024, "random", "load", False, ["dma", "dma2d"]),
    ]),
}


def _line(section: str, case: tuple, r: dict) -> str:
    blocks, ids, direction, _, _ = case
    text = (f"{section:12s} {blocks:5d} {ids[:4]} {direction:4s} {r['backend']:14s} {r['gbps']:6.1f} GB/s "
            f"submit {r['submit_ms']:8.3f} ms desc {r.get('descriptors', '-')!s:>6s} ok={r['verified']}")
    if "gemm_slowdown" in r:
        text += f" gemm x{r['gemm_slowdown']:.3f} copy-in-gemm {r['copy_gbps_during_gemm']:5.1f}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("section", choices=list(SECTIONS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    layout, alloc, cases = SECTIONS[args.section]
    device = torch.device("cuda")
    t_start = time.perf_counter()
    rig = Rig.allocate(SPEC, layout, 2048, device, alloc=alloc)
    ceiling = measure_ceiling(rig)
    print(f"{args.section}: rig {time.perf_counter() - t_start:.1f} s, ceiling {ceiling}", flush=True)
    gemm = GemmLoad.make(device)
    probe = gemm_alone(gemm, 10)
    count = max(20, int(300 / probe))
    alone = gemm_alone(gemm, count)
    print(f"gemm alone {alone:.3f} ms/product ({count} per window)", flush=True)
    report = {"section": args.section, "layout": layout, "alloc": alloc, "ceiling_gbps": ceiling,
              "gemm_ms_alone": alone, "results": []}
    for case in cases:
        blocks, ids, direction, with_gemm, names = case
        plans = make_plans(rig, blocks, ids, direction, seed=blocks)
        for name in names:
            try:
                backend = VARIANTS[name]()
                backend.register(rig.regions)
                r = bench_backend(rig, name, backend, plans, repeat=max(args.repeat, 2048 // blocks),
                                  gemm=gemm if with_gemm else None, gemm_count=count, gemm_alone_ms=alone)
            except Exception as exc:  # noqa: BLE001 - one broken variant must not end the sweep
                traceback.print_exc()
                r = {"backend": name, "error": f"{type(exc).__name__}: {exc}"}
                print(f"{args.section} {case[:3]} {name}: ERROR {r['error']}", flush=True)
            else:
                print(_line(args.section, case, r), flush=True)
            r.update({"blocks": blocks, "ids": ids, "direction": direction})
            report["results"].append(r)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"sweep_{args.section}.json").write_text(json.dumps(report, indent=1))
    print(f"{args.section}: done in {time.perf_counter() - t_start:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
