#!/usr/bin/env bash
# The GPU runs the open issues still need, batched for a device session (H200, no network). Run from the repository
# root on the GPU machine after installing the carried wheels (diffusers, sageattention, av, importlib_metadata and a
# wheel of this tree: `pip wheel --no-deps --no-build-isolation -w .whl .`) into /tmp/site:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   bash measurements/h200_next_session.sh part1 $OUT      # ~6 min: checkpoint, whole-request peak, streaming
#   bash measurements/h200_next_session.sh part2 $OUT      # ~8 min: arms session (#10), VAE (#11), NVFP4 (#6)
#
# Each part writes its records under $OUT (copy them to measurements/sessions/<date>_<topic>/ with a README stating
# command, commit, GPU and versions). Parts share /tmp/syn: run part2 right after part1, while the machine is warm.
set -euo pipefail
part=${1:?part1 or part2}
out=${2:?output folder}
repo=$(pwd)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd /tmp  # so `python3 -m k6fast...` imports the installed wheel, not the source tree

case "$part" in
part1)
  [ -d /tmp/syn ] || python3 -m k6fast.cli make-synthetic /tmp/syn --preset pro-distill --blocks 12
  # #4: the whole request's peak at W1 under a 32 GiB budget, resident share of the 60-block model (21/60 -> 4/12).
  K6_VRAM_BUDGET_GB=32 K6_MAX_RESIDENT_BLOCKS=4 python3 -m k6fast.cli generate --model /tmp/syn \
    --prompt "A brass band marches through rain" --out "$out/w1_budget32.mp4" 2>&1 | tail -20
  # #4: small geometry with the chunked 8-thread reader (was 3.75x resident with 4 threads, one per tensor).
  python3 "$repo/measurements/bench_streaming.py" --model /tmp/syn --budget-gb 32 --geometry 512x320x25 \
    --forwards 5 --out "$out/stream_small.json" | tail -7
  ;;
part2)
  test -f /tmp/syn/model_index.json || { echo "run part1 first on this machine"; exit 1; }
  # #10: reference / final / fast / diffusers per request at W1 (one visit each, mirrored order).
  python3 -m k6fast.cli bench --model /tmp/syn --arms reference,final,fast,diffusers --component pipeline \
    --geometry w1 --order ABBA --repeats 1 --requests 1 --topic h200-arms-w1 --out "$out/sessions"
  # #11: video decode vs diffusers' tiled decode.
  timeout 200 python3 "$repo/measurements/bench_vae_decode.py" --budget-gb 8 --out "$out/vae_decode.json" | tail -12
  # #6: NVFP4 and stored-fp8 GEMMs vs cuBLAS.
  timeout 120 python3 "$repo/measurements/bench_nvfp4.py" --out "$out/nvfp4.json" | tail -12
  ;;
*)
  echo "expected part1 or part2, found $part" >&2
  exit 2
  ;;
esac
