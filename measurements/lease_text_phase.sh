#!/usr/bin/env bash
# A short H200 lease (run from the repository root on the GPU machine): the GPU test suite, and the text phase at
# real size (Qwen2.5-VL-7B + CLIP-L shapes, random weights, in RAM-backed /dev/shm beside a one-block Lite DiT), with
# its per-layer breakdown; the DF11 benchmark (measurements/bench_df11.py).
#
#   WHEELS=DIR bash measurements/lease_text_phase.sh start   # in the background (setsid); wheels in DIR/a (default
#                                                            # .whl; see acceptance_lease.sh), nvCOMP's in DIR/d if carried
#   bash measurements/lease_text_phase.sh status OUT
#
# flash-attn-4 is not installed here (its tests skip); torchao is. Built on acceptance_lease.sh's install, checkpoint
# writer and sharded GPU tests.
set -uo pipefail
W=${LEASE_DIR:-/tmp/lease}
repo=$(pwd)
export LEASE_DIR=$W PRESET=lite-distill BLOCKS=1 TEXT=full TEXT_DIR=/dev/shm/k6-text
case "${1:?expected start, run or status}" in
start)
  mkdir -p $W
  setsid nohup bash "$repo/measurements/lease_text_phase.sh" run > $W/text_lease.log 2>&1 < /dev/null &
  echo "started $!"
  ;;
run)
  bash measurements/acceptance_lease.sh install "${WHEELS:-.whl}/a" --self > $W/install.log 2>&1
  bash measurements/acceptance_lease.sh install "${WHEELS:-.whl}/a/srv" >> $W/install.log 2>&1
  bash measurements/acceptance_lease.sh check
  touch $W/fa4.ready  # no flash-attn-4 in this lease: its tests skip
  # The GPU tests run while the checkpoint is written (the writer is mostly host work); the benchmark alone after.
  bash measurements/acceptance_lease.sh run gpu-tests
  # The lossless compressed format (#38): ratio, encode and decode GB/s, nvCOMP beside it where its wheels came.
  # (Not `acceptance_lease.sh run df11`: a second `run` would start a second checkpoint writer.)
  PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 timeout 240 python3 measurements/bench_df11.py --out $W/df11.json \
    > $W/df11.log 2>&1
  echo "df11 exit $?"; tail -20 $W/df11.log
  while [ ! -f $W/synthetic.done ]; do sleep 2; done
  tail -3 $W/synthetic.log
  export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  timeout 300 python3 measurements/bench_text_phase.py --model $W/syn --out $W/text_phase.json --prompts 3 \
    --dit-resident-gb 17 --breakdown > $W/text_phase.log 2>&1
  echo "text phase exit $?"; tail -10 $W/text_phase.log
  touch $W/text_lease.done
  ;;
status)
  out=${2:?OUT folder}
  tail -25 $W/text_lease.log 2>/dev/null
  cp $W/text_lease.log $W/text_phase.json $W/text_phase.log $W/synthetic.log $W/df11.json $W/df11.log "$out"/ 2>/dev/null
  tail -q -n 3 $W/pytest_gpu_*.log 2>/dev/null > "$out"/pytest_tails.txt
  cat $W/pytest_gpu_*.log > "$out"/pytest_gpu.log 2>/dev/null
  ls "$out"
  ;;
esac
