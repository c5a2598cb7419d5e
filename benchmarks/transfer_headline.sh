#!/usr/bin/env bash
# The `kvkit bench transfer` commands behind BENCHMARKS.md's GPU copy figures.
# Appends each command and its JSON report (one line) to $OUT/headline.jsonl.
set -uo pipefail
export PYTHONUNBUFFERED=1
command -v kvkit >/dev/null || kvkit() { python3 -c 'import sys; from kvkit.cli import main; sys.argv[0] = "kvkit"; main()' "$@"; }
run() {
  local cmd="kvkit bench transfer $*"
  echo "\$ $cmd"
  if kvkit bench transfer "$@" --json > /tmp/report.json 2>/tmp/err.txt; then
    python3 - "$cmd" <<'PY'
import json, os, sys
report = json.load(open("/tmp/report.json"))
report["command"] = sys.argv[1]
with open(os.path.join(os.environ["OUT"], "headline.jsonl"), "a") as f:
    f.write(json.dumps(report) + "\n")
c = report["ceiling_gbps"]
for r in report["results"]:
    line = f"  {r['backend']:12s} {r['gbps']:6.1f} GB/s (ceiling {c:5.1f}) submit {r['submit_ms']:7.3f} ms"
    if "submit_us_per_descriptor" in r:
        line += f" ({r['descriptors']} desc, {r['submit_us_per_descriptor']:.2f} us/desc)"
    if "gemm_slowdown" in r:
        line += f" gemm x{r['gemm_slowdown']:.3f} (copy {r['copy_gbps_during_gemm']:.1f} GB/s in window)"
    print(line + ("" if r["verified"] else " NOT VERIFIED"))
PY
  else
    echo "  FAILED rc=$?"; tail -5 /tmp/err.txt
  fi
}
run --backend all --layout per-layer --blocks 256 --ids random --direction store --with-gemm
run --backend all --layout per-layer --blocks 256 --ids random --direction load --with-gemm
run --backend all --layout per-layer --blocks 256 --ids random --direction both
run --backend all --layout per-layer --blocks 16 --ids random --direction store
run --backend all --layout per-layer --blocks 16 --ids random --direction load
run --backend cuda-dma --layout per-layer --blocks 256 --ids consecutive --direction store
run --backend cuda-dma --layout per-layer --blocks 256 --ids consecutive --direction load
run --backend all --layout cross-layer --blocks 256 --ids random --direction store --with-gemm
run --backend all --layout cross-layer --blocks 256 --ids random --direction load --with-gemm
run --backend all --layout cross-layer --blocks 256 --ids random --direction both
run --backend all --layout blocks-first --blocks 256 --ids random --direction store
run --backend all --layout blocks-first --blocks 256 --ids random --direction load
run --backend all --layout per-layer --blocks 1024 --ids random --direction store
run --backend cuda-dma --layout per-layer --blocks 1024 --ids random --direction load
run --backend cuda-dma --layout per-layer --alloc tensors --blocks 256 --ids random --direction store
