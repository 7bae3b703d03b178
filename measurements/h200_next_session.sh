#!/usr/bin/env bash
# The GPU run the open work still needs, for one device session (H200, no network). Run from the repository root on
# the GPU machine after installing the carried wheels (diffusers, sageattention, av, importlib_metadata and a wheel of
# this tree: `pip wheel --no-deps --no-build-isolation -w .whl .`) into /tmp/site:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   bash measurements/h200_next_session.sh decode $OUT   # ~5 min: checkpoint, the decode as generate runs it
#
# Done since, no longer here: the arms session with the exact decode (2026-11-29_h200-arms-w1-exact), NVFP4 GEMMs and
# the head_dim-64 attention configs (2026-11-29_attention-pipeline), the GPU tests of the 128-key attention prologue,
# the video decode, GroupNorm+SiLU, pipeline decode and q/k RMSNorm+RoPE (2026-11-29_block-fusions).
#
# Records go under $OUT (copy them to measurements/sessions/<date>_<topic>/ with a README stating command, commit,
# GPU and versions). Call `python3 -m k6fast.cli`, never a shell function, under `timeout`.
set -uo pipefail
part=${1:?expected: decode}
out=${2:?output folder}
repo=$(pwd)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd /tmp  # so `python3 -m k6fast...` imports the installed wheel, not the source tree
step() { echo; echo "=== $* ($(date +%T))"; }

case "$part" in
decode)
  step make-synthetic
  [ -f /tmp/syn/model_index.json ] || python3 -m k6fast.cli make-synthetic /tmp/syn --preset pro-distill --blocks 12 | tail -1
  # #11: the decode as generate runs it under a 32 GiB card budget (the lean variant that recomputes the shortcut).
  step vae decode, capped at 32 GiB
  timeout 200 python3 "$repo/measurements/bench_vae_decode.py" --variants ndhwc+bench+triton --budget-gb 8 \
    --exact-budget-gb 29 --upsample-fusion auto,recomputed --cap-gb 32 --repeats 2 --no-profile \
    --out "$out/vae_capped.json" | tail -12
  ;;
*)
  echo "expected decode, found $part" >&2
  exit 2
  ;;
esac
