#!/usr/bin/env bash
# `k6fast tune` at full depth on one GPU, as a plumbing run: the full-depth synthetic Pro-distill checkpoint (random
# weights, real shapes), a reduced geometry (480x272x49, stated in tune.json), the first 2 prompts of set A, a budget
# of 6 gate runs, the random LPIPS backbone marked as a test (--test). Run from the repository root:
#
#   bash measurements/run_tune.sh OUT [more `k6fast tune` options]
#   setsid nohup bash measurements/run_tune.sh OUT > OUT.log 2>&1 &     # unattended (a lease's command limit)
#
# MODEL (default $LEASE_DIR/syn, what acceptance_lease.sh writes) is written with `k6fast make-synthetic --preset
# pro-distill` when it is missing (tens of minutes for 60 GB). Where acceptance_lease.sh installed the packages into
# $LEASE_SITE (default /tmp/site), that copy runs; else `python3 -m k6fast.cli` of the current environment.
# Quantized attention is left out of the knobs: on an H200 its speed-up does not pay for its error
# (measurements/sessions/2026-11-29_attention-tree, as final.env says), and each knob level costs a bench probe.
# What it leaves in OUT: tune.json (every candidate's switches, speed, scores, pass/fail, why skipped), tuned.env,
# arms/, bench/ (each timing's session), gate/ (each candidate's report), clips/ (the reference's clips, made once).
# A dry run on a CPU: MODEL=/tmp/k6-tiny GEOMETRY=64x64x9 bash measurements/run_tune.sh OUT --device cpu --budget 2
set -euo pipefail
out=$(realpath -m "${1:?expected OUT, the folder tune writes}")
shift
W=${LEASE_DIR:-/tmp/lease}
MODEL=$(realpath -m "${MODEL:-$W/syn}")
GEOMETRY=${GEOMETRY:-480x272x49}
SITE=${LEASE_SITE:-/tmp/site}
repo=$(pwd)
if [ -d "$SITE/k6fast" ]; then
  export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
  k6() { (cd /tmp && python3 -m k6fast.cli "$@"); }  # the installed copy, not the source tree
else
  k6() { python3 -m k6fast.cli "$@"; }
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
[ -f "$MODEL/model_index.json" ] || k6 make-synthetic "$MODEL" --preset pro-distill
python3 - "$repo/quality_gate/setA.json" "$out/prompts.json" <<'EOF'
import json, sys
prompts = json.load(open(sys.argv[1]))["prompts"][:2]
json.dump({"prompts": prompts}, open(sys.argv[2], "w"), indent=1)
EOF
k6 tune --model "$MODEL" --prompts "$out/prompts.json" --lpips-max 0.15 --audio-max 3 --budget 6 \
  --geometry "$GEOMETRY" --knobs gemm,sparse,exact_blocks,exact_first_steps,exact_last_steps,cache \
  --lpips-backbone random --test --out "$out" "$@"
