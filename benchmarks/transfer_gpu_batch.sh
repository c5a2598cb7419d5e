#!/usr/bin/env bash
# One device call: GPU tests, then sweep sections ("name:timeout_s" words in $SECTIONS).
# Test log and one JSON file per section land in $OUT; summary lines on stdout.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, cupy, numpy; print(torch.__version__, cupy.__version__, numpy.__version__)"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-100} $(command -v pytest || echo python3 -m pytest) -p no:cacheprovider tests/backends/copy \
    -q --maxfail=8 2>&1 | tee $OUT/pytest_gpu.log | tail -12
fi
for item in ${SECTIONS:-main:170}; do
  section=${item%%:*}; limit=${item##*:}
  timeout $limit python3 benchmarks/transfer_sweep.py $section --out $OUT > /tmp/sweep_$section.log 2>&1
  echo "== $section rc=$?"; grep -v "^ \|^Traceback\|^  File" /tmp/sweep_$section.log | cut -c1-150
done
