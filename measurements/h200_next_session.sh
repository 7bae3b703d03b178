#!/usr/bin/env bash
# The GPU runs the open work still needs, batched for one device session (H200, no network). Run from the repository
# root on the GPU machine after installing the carried wheels (diffusers, sageattention, av, importlib_metadata and a
# wheel of this tree: `pip wheel --no-deps --no-build-isolation -w .whl .`) into /tmp/site:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   bash measurements/h200_next_session.sh part1 $OUT   # ~9 min: checkpoint, arms session with the exact decode
#   bash measurements/h200_next_session.sh part2 $OUT   # ~4 min: the decode as generate runs it (capped allocator)
#   bash measurements/h200_next_session.sh part3 $OUT   # ~4 min: GPU tests, NVFP4 GEMMs, attention at head_dim 64
#
# Done in the 2026-11-29 afternoon session, no longer here: the fast arm's second-request recompile check and the
# head_dim-128 attention sweep (measurements/sessions/2026-11-29_h200-kernels2, _attention-sweep).
#
# Each part writes its records under $OUT (copy them to measurements/sessions/<date>_<topic>/ with a README stating
# command, commit, GPU and versions). part2 needs part1's /tmp/syn: run it right after part1, while the machine is
# warm (it is released 30 s after a call). Call `python3 -m k6fast.cli`, never a shell function, under `timeout`.
set -uo pipefail
part=${1:?part1, part2 or part3}
out=${2:?output folder}
repo=$(pwd)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd /tmp  # so `python3 -m k6fast...` imports the installed wheel, not the source tree
step() { echo; echo "=== $* ($(date +%T))"; }

case "$part" in
part1)
  step make-synthetic
  [ -d /tmp/syn ] || python3 -m k6fast.cli make-synthetic /tmp/syn --preset pro-distill --blocks 12 | tail -1
  # #10: the arms session again, now with the exact decode (the default), the quant-attention custom op, the
  # 128-key attention tile and the fused q/k RMSNorm+RoPE.
  step arms session W1
  timeout 560 python3 -m k6fast.cli bench --model /tmp/syn --arms reference,diffusers-offload,final,fast \
    --component pipeline --geometry w1 --order ABAB --repeats 1 --requests 1 --visit-timeout 200 \
    --set K6_VRAM_BUDGET_GB=32 --set K6_MAX_RESIDENT_BLOCKS=4 --topic h200-arms-w1-exact --out "$out/sessions" | tail -12
  ;;
part2)
  test -f /tmp/syn/model_index.json || { echo "run part1 first on this machine"; exit 1; }
  # #11: the decode as generate runs it under a 32 GiB card budget (the lean variant that recomputes the shortcut).
  step vae decode, capped at 32 GiB
  timeout 200 python3 "$repo/measurements/bench_vae_decode.py" --variants ndhwc+bench+triton --budget-gb 8 \
    --exact-budget-gb 29 --upsample-fusion auto,recomputed --cap-gb 32 --repeats 2 --no-profile \
    --out "$out/vae_capped.json" | tail -12
  ;;
part3)
  step gpu tests
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider "$repo/tests/test_quant_attention.py" \
    "$repo/tests/test_video_decode.py" "$repo/tests/test_groupnorm_silu.py" "$repo/tests/test_pipeline_decode.py" \
    "$repo/tests/test_qk_norm_rope.py" 2>&1 | tail -4
  step nvfp4
  timeout 90 python3 "$repo/measurements/bench_nvfp4.py" --out "$out/nvfp4.json" | tail -12
  step attention configs, head_dim 64 '(Lite)'
  timeout 200 python3 "$repo/measurements/bench_attention.py" --head-dim 64 --sweep --sweep-k-blocks 64,128 \
    --sweep-rep-ms 300 --rep-ms 600 --out "$out/attention_d64.json" | tail -16
  ;;
*)
  echo "expected part1, part2 or part3, found $part" >&2
  exit 2
  ;;
esac
