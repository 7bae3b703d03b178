#!/usr/bin/env bash
# The GPU runs the open issues still need, batched for a device session (H200, no network). Run from the repository
# root on the GPU machine after installing the carried wheels (diffusers, sageattention, av, importlib_metadata and a
# wheel of this tree: `pip wheel --no-deps --no-build-isolation -w .whl .`) into /tmp/site:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   bash measurements/h200_next_session.sh part1 $OUT   # ~8 min: checkpoint, smoke of the arms, whole-request
#                                                       #   peak, small-geometry streaming, GPU tests, GEMMs
#   bash measurements/h200_next_session.sh part2 $OUT   # ~9 min: the arms session at W1 under a 32 GiB budget (#10)
#   bash measurements/h200_next_session.sh part3 $OUT   # ~6 min: VAE decode (#11), attention configs (#5)
#
# Each part writes its records under $OUT (copy them to measurements/sessions/<date>_<topic>/ with a README stating
# command, commit, GPU and versions). part2 needs part1's /tmp/syn: run it right after part1, while the machine is warm.
set -uo pipefail
part=${1:?part1, part2 or part3}
out=${2:?output folder}
repo=$(pwd)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd /tmp  # so `python3 -m k6fast...` imports the installed wheel, not the source tree
k6() { python3 -m k6fast.cli "$@"; }
step() { echo; echo "=== $* ($(date +%T))"; }

case "$part" in
part1)
  step make-synthetic
  [ -d /tmp/syn ] || k6 make-synthetic /tmp/syn --preset pro-distill --blocks 12 | tail -2
  # The arms' code paths at a small geometry first (fp8 + k6 attention + fused + compile + cache), 3 steps.
  step smoke fast arm 512x320x25
  timeout 240 python3 -m k6fast.cli generate --model /tmp/syn --arm fast --steps 3 --size 512x320 --frames 25 \
    --prompt "A brass band marches through rain" --out "$out/smoke_fast.mp4" 2>&1 | tail -8
  # #4: the whole request's peak at W1 under a 32 GiB budget; 4 of 12 blocks resident = the 60-block model's 18/60.
  step whole request W1 budget 32
  K6_VRAM_BUDGET_GB=32 K6_MAX_RESIDENT_BLOCKS=4 timeout 200 python3 -m k6fast.cli generate --model /tmp/syn \
    --prompt "A brass band marches through rain" --out "$out/w1_budget32.mp4" 2>&1 | tail -22
  rm -f "$out/w1_budget32.mp4" "$out/smoke_fast.mp4"  # keep the sidecars (telemetry), not the videos
  # #4: small geometry with the chunked 8-thread reader (was 3.75x resident with 4 threads, one per tensor).
  step streaming 512x320x25
  timeout 120 python3 "$repo/measurements/bench_streaming.py" --model /tmp/syn --budget-gb 32 \
    --geometry 512x320x25 --forwards 5 --out "$out/stream_small.json" | tail -7
  step gpu tests
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider "$repo/tests/test_nvfp4.py" \
    "$repo/tests/test_quantize.py" "$repo/tests/test_video_decode.py" "$repo/tests/test_groupnorm_silu.py" \
    "$repo/tests/test_fp8_linear.py" 2>&1 | tail -15
  step gemm
  timeout 90 python3 "$repo/measurements/bench_gemm.py" --rep-ms 100 --out "$out/gemm.json" | tail -32
  step nvfp4
  timeout 90 python3 "$repo/measurements/bench_nvfp4.py" --out "$out/nvfp4.json" | tail -12
  ;;
part2)
  test -f /tmp/syn/model_index.json || { echo "run part1 first on this machine"; exit 1; }
  # #10: reference / diffusers group offload / final / fast per request at W1, every arm under the 32 GiB budget
  # (the peer's allocator capped too), 4 of 12 blocks resident for the k6fast arms.
  step arms session W1
  timeout 580 python3 -m k6fast.cli bench --model /tmp/syn --arms reference,diffusers-offload,final,fast \
    --component pipeline --geometry w1 --order ABAB --repeats 1 --requests 1 --visit-timeout 200 \
    --set K6_VRAM_BUDGET_GB=32 --set K6_MAX_RESIDENT_BLOCKS=4 --topic h200-arms-w1 --out "$out/sessions" | tail -14
  ;;
part3)
  # #11: video decode vs diffusers' tiled decode (budgeted streaming decode, exact whole-clip decode).
  step vae decode
  timeout 330 python3 "$repo/measurements/bench_vae_decode.py" --budget-gb 8 --exact-budget-gb 48 --repeats 2 \
    --out "$out/vae_decode.json" | tail -16
  step attention configs
  timeout 150 python3 "$repo/measurements/bench_attention.py" --sweep --rep-ms 600 --out "$out/attention.json" | tail -16
  ;;
*)
  echo "expected part1, part2 or part3, found $part" >&2
  exit 2
  ;;
esac
