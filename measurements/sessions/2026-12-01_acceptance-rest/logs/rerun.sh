#!/usr/bin/env bash
# This lease's second half (untracked helper): the residency test again, the Ray Serve bench run from /tmp (Ray adds
# the driver's working directory to its workers' sys.path: from the repository root the source tree shadowed the
# installed k6fast), then the exact-attention bench if time is left.
set -uo pipefail
W=/tmp/lease; repo=$(pwd)
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export RAY_USAGE_STATS_ENABLED=0
echo "=== ballast runs ($(date +%T))"
(cd /tmp && python3 -m k6fast.cli acceptance --model $W/syn --geometry w1 --out $W/record --work $W/work --timeout 420 \
  --only reference-32-warm-host60,final-32-warm-host60) 2>&1 | grep acceptance
echo "=== residency test ($(date +%T))"
(cd $repo && timeout 120 python3 -P -m pytest -m gpu -q -p no:cacheprovider tests/test_residency_gpu.py \
  > $W/pytest_gpu_5.log 2>&1; tail -1 $W/pytest_gpu_5.log)
cd /tmp
for spec in 2x0.5:4 1x1:2; do
  config=${spec%%:*}; n=${spec##*:}
  echo "=== ray $config, $n requests ($(date +%T))"
  timeout 560 python3 $repo/measurements/bench_ray_serve.py --model $W/syn --arm final --budget-gb 32 --geometry w1 \
    --requests $n --warmup 0 --configs $config --set K6_INDUCTOR_CACHE_DIR=$W/work/cache/final --timeout-s 540 \
    --out $W/ray_$config.json > $W/ray_$config.log 2>&1
  echo "exit $?"; tail -4 $W/ray_$config.log
done
python3 $repo/measurements/bench_ray_serve.py --report $W/ray_1x1.json $W/ray_2x0.5.json --out $W/ray_serve.json | tail -6
echo "=== sparse attention ($(date +%T))"
(cd $repo && timeout 300 python3 measurements/bench_sparse_attention.py --out $W/sparse_attention.json \
  > $W/sparse_attention.log 2>&1); tail -12 $W/sparse_attention.log
echo "=== exact attention ($(date +%T))"
(cd $repo && timeout 300 python3 measurements/bench_flash_attention.py --rep-ms 300 --out $W/exact_attention.json \
  > $W/exact_attention.log 2>&1); tail -12 $W/exact_attention.log
echo "=== done ($(date +%T))"
touch $W/rerun.done
