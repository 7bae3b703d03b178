#!/usr/bin/env bash
# One H200 lease for the user's envelope (#33) and the session's GPU checks: the GPU test suite, the text phase at
# real size (per-layer breakdown), `k6fast acceptance` with the real-size text encoders, `k6fast serve` at its
# defaults, `final` beside the 60 GB host ballast, the df11 benchmark, and the diffusers peer (on the same DiT with
# one-layer text encoders: it holds the DiT and its text encoders in host memory). Built on acceptance_lease.sh.
#
# From the source tree of the commit under test (a `git archive` unpacked on the GPU machine, so edits in the
# working tree do not leak into the lease), with the wheels of acceptance_lease.sh's header in $WHEELS:
#   WHEELS=/path/.whl bash measurements/lease_envelope.sh start    # install, check, run the steps in the background
#   bash measurements/acceptance_lease.sh status OUT               # progress and records so far
# flash-attn-4 arrives in two later calls (`acceptance_lease.sh join ...`), which touch $W/fa4.ready. The wheels and
# the three calls, each carrying one folder that `bash measurements/lease_wheels.sh` lays out. The commit under test
# is the working tree the call carries, copied aside (a `git archive` beside .whl/a passes the 64 MiB a call
# carries), so the working tree must be clean at that commit:
#   1, carry .whl/a: R=$PWD; mkdir -p /tmp/src && tar cf - --exclude=./.whl . | tar xf - -C /tmp/src &&
#      echo "$(git rev-parse --short HEAD) (clean working tree)" > /tmp/src/LEASE_COMMIT && cd /tmp/src &&
#      WHEELS=$R/.whl bash measurements/lease_envelope.sh start
#   2, carry .whl/b: cp .whl/b/cu13.partaa /tmp/lease/cu13.whl.partaa &&
#      bash measurements/acceptance_lease.sh install $PWD/.whl/b
#   3, carry .whl/c: bash measurements/acceptance_lease.sh install $PWD/.whl/c &&
#      cp .whl/c/cu13.partab /tmp/lease/cu13.whl.partab && bash measurements/acceptance_lease.sh join cu13.whl fa4.ready
# then polls (`sleep N; ... status OUT`) back to back: the machine goes after about 30 s without a call.
set -uo pipefail
W=${LEASE_DIR:-/tmp/lease}
WHEELS=${WHEELS:?the folder of wheels (lease_wheels.sh: a/ here, b/ and c/ in the next two calls)}
# The DF11 lease (issue #38), the default: the BF16 rows first (df11-to-disk deletes the BF16 DiT to make room for
# the ballast run on the compressed copy), then the compressed copy written on the GPU and its rows, free host and
# beside the 60 GB ballast (its text encoders moved to the disk as well, as a user's are: the BF16 ballast row has them
# in RAM-backed /dev/shm, inside what it leaves). Dry-run on a CPU with BLOCKS=2 PRESET=lite-distill GEOMETRY=64x64x5
# DF11_DIR=... DF11_DEVICE=cpu TEXT_LINKED=1 TEXT_DIR=... measurements/sessions/2026-12-02_acceptance-df11 ran it with
# first-step:final after the BF16 rows; its write failed on the linked text encoder folders (fixed since).
# The envelope lease of measurements/sessions/2026-12-02_acceptance-envelope4 (serve at its defaults, `final` beside
# the peer) was:
#   STEPS="gpu-tests peer-checkpoint serve:reference:32:first serve:step-cache:32:first serve:reference:31:first \
#   serve:step-cache:31:first serve:fast:32 acceptance:final-32-cold,final-32-warm drop-text \
#   acceptance:diffusers-offload-32-cold"
STEPS=${STEPS:-gpu-tests acceptance:final-32-cold,reference-32-warm,final-32-warm acceptance:final-32-warm-host60 \
df11-checkpoint acceptance:reference-32-warm-df11,final-32-warm-df11 df11-to-disk drop-text \
acceptance:final-32-warm-host60-df11}
# The every-second lease (issue #35: each arm it names beside the peer in one session; about 15 minutes):
#   STEPS="gpu-tests peer-checkpoint acceptance:fast-32-cold,fast-32-warm,final-32-cold,final-32-warm drop-text \
#   acceptance:diffusers-offload-32-cold"
# The tune lease (issue #36: `k6fast tune` at full depth, which has never run on a GPU; every probe and candidate is a
# bench process of its own and every gated one two clips more, so it needs a lease of its own). A CPU dry run on the
# tiny checkpoint (run_tune.sh's header) made 4 bench visits and 2 gate runs; at full depth the sparse and exact-
# attention knobs join, so expect about 12 visits of about 50 s (imports, a load from the page cache, a warm-up and
# a timed request at 480x272x49) and 6 gate runs of about 30 s; the GPU suite goes last:
#   STEPS="tune gpu-tests" TUNE_TIMEOUT=1200 (TUNE_ARGS: more `k6fast tune` options)
# The Pro base lease (issue #36: the 50-step base checkpoint at full depth, the first 19 of its steps a run, per-step
# times and each run's projected 50-step request (k6fast/bench/projection.py) side by side with the peer's). Every
# kind of step fast-base's schedule has must be measured past its first (first-use work is left out): its all-exact
# first 10 steps, then its middle steps. The first lease's calibration (measurements/sessions/
# 2026-12-03_acceptance-pro-base) called every third step after step 10 (12, 15, 18, ...), so 16 steps left one
# middle step past the first, and 19 leave two. Its step cache needs a calibration at 50 steps first. That first lease
# (1,738 s of device time, with the GPU suite first) lost the peer to the 420 s run timeout. Hence the timeout here,
# and the GPU suite last, where running out of device time costs only it (each poll brings back the record and the
# sidecars). The margin is thin: from that lease's log the steps before the peer take about 1,100 s of the 1,800
# (the machine's start and installs included), which leaves the peer about 650 s; it was estimated at about 370 s for
# 16 steps and ran past 420 s, so 19 steps may take 500 s or more. So the peer stops after 10 (its steps all stream
# the same blocks from host memory: 9 after its first show it), about 250 s, which leaves room for a machine that
# failed to start once (each refusal costs about 90 s of the budget). The second lease (measurements/sessions/
# 2026-12-03_acceptance-pro-base2) had its steps start at 215 s (a slow machine start), the acceptance at 423 s, and
# `reference` take 376 s, `final` 286 s: with `fast-base` (about 215 s) and the peer (about 260 s) the recipe needs
# about 1,570 s. That lease was lost when its polls stopped during `fast-base`. With less than 1,650 s of budget
# left, leave reference-32-cold out of the acceptance step: both leases measured it (18.60 and 18.30 s a step), and
# the ratio targets are to the peer:
#   PRESET=pro ACCEPTANCE_TIMEOUT=900 \
#   ACCEPTANCE_ARGS="--arms reference,final,fast-base --stop-after-steps 19 --peer-stop-after-steps 10" \
#   STEPS="peer-checkpoint calibrate:fast-base:256x144x9 acceptance:reference-32-cold,final-32-cold,\
#   fast-base-32-cold drop-text acceptance:diffusers-offload-32-cold gpu-tests"
case "${1:?expected start}" in
start)
  mkdir -p $W
  bash measurements/acceptance_lease.sh install "$WHEELS/a" --self > $W/install.log 2>&1
  tail -3 $W/install.log
  TEXT=full bash measurements/acceptance_lease.sh check
  # shellcheck disable=SC2086
  TEXT=full SERVE_TIMEOUT=${SERVE_TIMEOUT:-420} bash measurements/acceptance_lease.sh start $STEPS
  ;;
*)
  echo "expected start" >&2
  exit 2
  ;;
esac
