#!/usr/bin/env bash
# One unattended H200 lease: the GPU test suite, `k6fast acceptance`, the benchmarks. Run from the repository root on
# the GPU machine.
#
#   bash measurements/acceptance_lease.sh check                 # python, packages, /dev/shm, disk, memory, GPU
#   bash measurements/acceptance_lease.sh install DIR [--self]  # the wheels in DIR (and this tree) into /tmp/site
#   bash measurements/acceptance_lease.sh join NAME READY       # cat $W/NAME.part* into NAME.whl, install, touch READY
#   bash measurements/acceptance_lease.sh start STEP...         # the steps in order, in the background (setsid)
#   bash measurements/acceptance_lease.sh status OUT            # progress; copies the records so far into OUT
#   bash measurements/acceptance_lease.sh stop                  # end the session early (its current step: current_step)
#
# The machine is given back, with everything on it, once it has been left without a call for about 30 s: poll
# with `sleep N; ... status OUT` calls back to back, and do other work only beside a poll, in the same batch (the
# first machine of measurements/sessions/2026-12-03_acceptance-every-second was lost mid-lease that way).
#
# Steps (each waits for what it needs; the 57 GB checkpoint is written in the background from the start):
#   gpu-tests          `pytest -m gpu` in four concurrent shards, then the tests that read the card's free memory
#   attention          exact attention kernels at W1 and the Lite shape, sparse attention per density
#   acceptance:SLUGS   `k6fast acceptance --only SLUGS --timeout $ACCEPTANCE_TIMEOUT` (each part continues the same
#                      record; ACCEPTANCE_ARGS adds options, e.g. "--arms reference,final,fast-base
#                      --stop-after-steps 19" for the Pro base)
#   serve:ARM:BUDGET   measurements/bench_serve_defaults.py: `k6fast serve --arm ARM` at its defaults under BUDGET GiB
#                      with the arm's compile cache ($W/work/cache/ARM, what `acceptance:ARM-32-cold` left), four jobs
#                      through the openai SDK, a DELETE, an oversize request; its record goes to $REC/serve/ and the
#                      record's README shows it (SERVE_ARGS: more options, e.g. smaller sizes for a dry run);
#                      serve:ARM:BUDGET:first runs only the first job (a W1 job of a fresh prompt) and the oversize
#                      request: that the arm starts and completes a job at that budget
#   page-cache         read the checkpoint once (after a ballast run evicted it from the page cache)
#   ray:CONFIG:N       measurements/bench_ray_serve.py, CONFIG (1x1, 2x0.5) with N requests, the `final` arm's cache
#   block              one Pro block: SDPA against flash-attn-4 for exact attention, under fused+compile
#   profile:ARM        measurements/profile_step.py: one full-depth request of ARM by phase, one DiT step by kernel
#   compile-diag       the `fast` block compiled, recompiles and graph breaks logged
#   peer-checkpoint    $W/syn-peer: the DiT of $W/syn linked with one-layer text encoders (from a one-block
#                      make-synthetic), for the peer, which holds the DiT and its text encoders in host memory
#   text-phase         measurements/bench_text_phase.py --breakdown on $W/syn (real-size encoders with TEXT=full)
#   decode-probe       measurements/probe_decode_first_call.py: a process's first W1 video decode against its second,
#                      each under torch.profiler, after 19 GB standing in for the DiT were freed (with empty_cache,
#                      then without: the decode reusing the mapped memory)
#   decode-profile     measurements/profile_video_decode.py: the W1 video decode alone (the request's plan at 32 GiB,
#                      a random VAE of the real config), timed and profiled by op and by kernel kind
#   first-step:ARM     measurements/profile_first_step.py: a warm process's first DiT step under cProfile (ARM's compile
#                      cache, what acceptance:ARM-32-cold left), 2 steps at GEOMETRY: where its extra seconds go
#   dit-ahead:ARM:N    measurements/bench_dit_ahead.py: N fresh `k6fast generate --arm ARM` processes a side with
#                      K6_DIT_AHEAD on and off, mirrored, after one not counted (ARM's compile cache, what
#                      acceptance:ARM-32-cold left), at GEOMETRY, 2 steps each: what building the DiT beside the
#                      imports saves (about 3 minutes for final at W1 with N=2)
#   calibrate:ARM:WxHxF  a step cache's calibration for ARM (`K6_STEP_CACHE=calibrate k6fast generate --arm ARM`, the
#                      checkpoint's own step count, every step run) at WxHxF: a magcache arm (fast-base) refuses a
#                      checkpoint it has no calibration for. The calibration is per checkpoint and step count, not per
#                      geometry or budget: a small geometry, and the card's whole memory (no K6_VRAM_BUDGET_GB unless
#                      CALIBRATE_BUDGET_GB is set) so that no block streams, keep the 50-step Pro base's 100 DiT
#                      passes short (at 32 GiB every pass would stream most of the DiT)
#   tune               measurements/run_tune.sh on $W/syn into $W/tune: `k6fast tune` at a reduced geometry (TUNE_GEOMETRY,
#                      default 480x272x49), 2 prompts, a budget of 6 gate runs, the random LPIPS backbone as a test
#   drop-text          remove $TEXT_DIR (the RAM-backed real-size text encoders) once no later step reads them
#   df11               measurements/bench_df11.py: the lossless compressed format's ratio, encode and decode GB/s
#   df11-checkpoint    `k6fast quantize --format df11 --device $DF11_DEVICE` of $W/syn into $DF11_DIR (default
#                      /dev/shm/syn-df11: the disk holds the BF16 DiT only; with TEXT=full the text encoders are hard
#                      links into $TEXT_DIR); the acceptance steps after it add --df11-model, which runs the `-df11`
#                      slugs on it
#   df11-to-disk       make room for a ballast run on the compressed DiT: delete the BF16 DiT's shards (the BF16
#                      checkpoint is unusable after this; run its rows and the peer first) and move the compressed
#                      copy to $W/syn-df11 with its text encoders copied from $TEXT_DIR where the disk has room for
#                      them (else linked from $TEXT_DIR as before); a drop-text after it frees their RAM
#
# Wheels the GPU machine lacks (python 3.12): diffusers, av, importlib_metadata, torchao (the block-scaled GEMM tests);
# flash-attn-4 with nvidia-cutlass-dsl (+ -libs-base, -libs-core, -libs-cu13), apache-tvm-ffi, torch-c-dlpack-ext,
# quack-kernels; for the serve step fastapi, uvicorn, python-multipart and openai (httpx, anyio, distro, jiter; without
# openai it runs over plain HTTP and says so); for the Ray step ray[serve] with its dependencies.
# (fastapi 0.165 imports opentelemetry and openai 3.57 imports httpx2: carry those, or releases without them, else
# the server tests skip; see measurements/sessions/2026-12-02_gpu-suite-h200.) A wheel larger than one call's carry
# (cutlass's cu13 libraries, ray) is split (`split -b 45m W.whl NAME.part`), its parts carried in consecutive calls
# into $W, and `join` puts it together. The steps wait for `$W/fa4.ready` and `$W/ray.ready` (5 minutes at most).
#
# TEXT=full: the checkpoint's text encoders at their real size (Qwen2.5-VL-7B with its vision tower and CLIP-L, random
# weights, about 16.8 GB) in $TEXT_DIR (default /dev/shm/k6-text, RAM-backed: the 64 GB disk holds the 60 GB DiT
# only), linked from the checkpoint; the acceptance record says so. They take that much of the host's memory for
# the whole session (beside a ballast too: they are inside what it leaves).
set -uo pipefail
# Overridable for a dry run on a small checkpoint (e.g. BLOCKS=2 PRESET=lite-distill GEOMETRY=64x64x5 on a CPU;
# TEXT_LINKED=1 puts its one-layer text encoders in $TEXT_DIR, linked, as TEXT=full does).
PRESET=${PRESET:-pro-distill}
# Seconds before one acceptance run is killed: 420 holds W1's 10-step runs with room; the Pro base's 19 CFG steps
# need more (its peer ran past 420 s in measurements/sessions/2026-12-03_acceptance-pro-base).
ACCEPTANCE_TIMEOUT=${ACCEPTANCE_TIMEOUT:-420}
BLOCKS=${BLOCKS:-}
GEOMETRY=${GEOMETRY:-w1}
TEXT=${TEXT:-one-layer}
TEXT_DIR=${TEXT_DIR:-/dev/shm/k6-text}
DF11_DIR=${DF11_DIR:-/dev/shm/syn-df11}
# Where df11-checkpoint compresses: the GPU (about 4 min for the 60 GB DiT; `quantize`'s own default, cpu, about 28).
DF11_DEVICE=${DF11_DEVICE:-cuda}
# Bytes free where TEXT_DIR goes: the full text encoders and their headers, with room to spare.
TEXT_NEEDS=${TEXT_NEEDS:-18000000000}
W=${LEASE_DIR:-/tmp/lease}
REC=$W/record
SITE=${LEASE_SITE:-/tmp/site}
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
repo=$(pwd)
k6() { (cd /tmp && python3 -m k6fast.cli "$@"); }  # the installed copy, not the source tree
step() { echo; echo "=== $* ($(date +%T))"; }
wait_for() {  # a marker file, polled every 5 s
  for _ in $(seq "${READY_POLLS:-60}"); do [ -f "$W/$1" ] && return 0; sleep 5; done
  echo "$1 never arrived"; return 1
}
checkpoint() {  # wait for the background writer
  while [ ! -f $W/synthetic.done ]; do sleep 2; done
  tail -2 $W/synthetic.log
}

gpu_tests() {
  wait_for fa4.ready
  cd "$repo" || return 1
  # Files whose tests read the card's free memory run alone; the rest in four shards, balanced by test count.
  python3 - "$W" <<'EOF'
import collections, subprocess, sys
out = subprocess.run([sys.executable, "-P", "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
                     capture_output=True, text=True).stdout
count = collections.Counter(line.split("::")[0] for line in out.splitlines() if "::" in line)
alone = {f for f in count if f.endswith("test_residency_gpu.py")}
shards = [[], [], [], []]
for f, n in count.most_common():
    if f not in alone:
        min(shards, key=lambda s: sum(count[x] for x in s)).append(f)
for i, files in enumerate([*shards, sorted(alone)]):  # shard4: alone
    open(f"{sys.argv[1]}/shard{i}.txt", "w").write("\n".join(files) + "\n")
print({i: sum(count[f] for f in s) for i, s in enumerate(shards)}, "alone:", sorted(alone))
EOF
  pids=()
  for i in 0 1 2 3; do
    [ -n "$(cat $W/shard$i.txt)" ] || continue  # no files would mean every test
    timeout 900 python3 -P -m pytest -m gpu -q -p no:cacheprovider -rs --durations=15 $(cat $W/shard$i.txt) \
      > $W/pytest_gpu_$i.log 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; echo "shard exit $?"; done
  timeout 300 python3 -P -m pytest -m gpu -q -p no:cacheprovider -rs $(cat $W/shard4.txt) > $W/pytest_gpu_4.log 2>&1
  echo "alone exit $?"
  for i in 0 1 2 3 4; do tail -1 $W/pytest_gpu_$i.log; done
  cd - > /dev/null || return 1
}

attention() {  # sparse first: its per-density record is what the sparse arm rests on
  (cd "$repo" && timeout 300 python3 measurements/bench_sparse_attention.py --out $W/sparse_attention.json \
    > $W/sparse_attention.log 2>&1); tail -12 $W/sparse_attention.log
  (cd "$repo" && timeout 300 python3 measurements/bench_flash_attention.py --rep-ms 300 --out $W/exact_attention.json \
    > $W/exact_attention.log 2>&1); tail -12 $W/exact_attention.log
}

acceptance() {  # the slugs to run, comma-separated
  checkpoint
  [ -f "$repo/LEASE_COMMIT" ] && mkdir -p $REC && cp "$repo/LEASE_COMMIT" $REC/commit.txt
  local peer=() df11=()
  [ -f $W/syn-peer/model_index.json ] && peer=(--peer-model $W/syn-peer)
  [ -f $W/df11.path ] && df11=(--df11-model "$(cat $W/df11.path)")
  # shellcheck disable=SC2086  # ACCEPTANCE_ARGS: more options, split on spaces (e.g. the Pro base's arms)
  k6 acceptance --model $W/syn --geometry "$GEOMETRY" --out $REC --work $W/work --timeout "$ACCEPTANCE_TIMEOUT" \
    "${peer[@]}" "${df11[@]}" ${ACCEPTANCE_ARGS:-} --only "$1"
}

peer_checkpoint() {  # the peer's copy: the same DiT, VAE and vocoder (links), one-layer text encoders
  checkpoint
  (cd /tmp && timeout 300 python3 -m k6fast.cli make-synthetic $W/one-layer-text --preset "$PRESET" --blocks 1) \
    > $W/peer_checkpoint.log 2>&1 || { echo "one-layer text encoders: exit $?"; tail -3 $W/peer_checkpoint.log; return 1; }
  rm -rf $W/syn-peer && mkdir -p $W/syn-peer
  for entry in $W/syn/*; do
    name=$(basename "$entry")
    case "$name" in
    text_encoder | text_encoder_2 | tokenizer | tokenizer_2) ln -s $W/one-layer-text/$name $W/syn-peer/$name ;;
    synthetic.json) ;;
    *) ln -s "$entry" $W/syn-peer/$name ;;
    esac
  done
  python3 - $W <<'PY'
import json, sys
w = sys.argv[1]
marker = json.load(open(f"{w}/syn/synthetic.json"))
marker["text_encoders"] = json.load(open(f"{w}/one-layer-text/synthetic.json")).get("text_encoders", "one-layer")
json.dump(marker, open(f"{w}/syn-peer/synthetic.json", "w"))
PY
  ls -la $W/syn-peer | tail -n +2
}

serve_bench() {  # ARM BUDGET [JOBS: all (default) or first]
  checkpoint
  local slug=$1-$2${3:+-$3} limit=${SERVE_TIMEOUT:-1200}
  # The script's own deadline ends it first, with its record; `timeout` (SIGTERM: the script stops the server and
  # writes what it measured) is the backstop.
  # TORCH_LOGS=recompiles: the server log names the guard behind each recompile (2026-12-02: every job compiled one
  # graph, a repeated geometry too; measurements/sessions/2026-12-02_acceptance-envelope).
  (cd "$repo" && TORCH_LOGS=recompiles timeout "$limit" python3 measurements/bench_serve_defaults.py --model $W/syn --arm "$1" --budget-gb "$2" \
    --set K6_INDUCTOR_CACHE_DIR=$W/work/cache/$1 --record $REC --work $W/work/serve-$slug --timeout-s $((limit - 60)) \
    --jobs "${3:-all}" ${SERVE_ARGS:-} > $W/serve_$slug.log 2>&1)
  echo "serve $1 $2 exit $?"; tail -12 $W/serve_$slug.log
}

write_checkpoint() {  # in the background from the start of a session; synthetic.done marks its end
  local text=()
  if [ "$TEXT" = full ]; then
    local room
    room=$(df --output=avail -B1 "$(dirname "$TEXT_DIR")" 2>/dev/null | tail -1)
    if [ "${room:-0}" -lt $TEXT_NEEDS ]; then
      echo "TEXT=full: $(dirname "$TEXT_DIR") has ${room:-no} bytes free, the text encoders need $TEXT_NEEDS"
      echo "checkpoint exit 1"
      return
    fi
    text=(--text-encoders full --text-encoder-dir "$TEXT_DIR")
  elif [ "$TEXT" != one-layer ]; then
    echo "TEXT=$TEXT: expected full or one-layer"; echo "checkpoint exit 1"; return
  fi
  (cd /tmp && timeout 1500 python3 -m k6fast.cli make-synthetic $W/syn --preset "$PRESET" ${BLOCKS:+--blocks $BLOCKS} \
    "${text[@]}")
  local code=$?
  if [ "$TEXT" = one-layer ] && [ "${TEXT_LINKED:-0}" = 1 ] && [ $code = 0 ]; then
    # A dry run in TEXT=full's layout: the text encoder folders in $TEXT_DIR, linked from the checkpoint (the
    # 2026-12-02 DF11 lease failed on links its one-layer dry run, with real folders, never had).
    mkdir -p "$TEXT_DIR"
    for name in text_encoder text_encoder_2; do
      mv $W/syn/$name "$TEXT_DIR/" && ln -s "$TEXT_DIR/$name" $W/syn/$name
    done
  fi
  echo "checkpoint exit $code"
}

ray_bench() {  # CONFIG N
  wait_for ray.ready || return 1
  export RAY_USAGE_STATS_ENABLED=0
  checkpoint
  local out=$W/ray_$1.json
  (cd "$repo" && timeout 560 python3 measurements/bench_ray_serve.py --model $W/syn --arm final --budget-gb 32 \
    --geometry "$GEOMETRY" --requests "$2" --warmup 0 --configs "$1" --set K6_INDUCTOR_CACHE_DIR=$W/work/cache/final \
    --timeout-s 540 --out "$out" > $W/ray_$1.log 2>&1)
  echo "ray $1 exit $?"; tail -4 $W/ray_$1.log
  local done_=($W/ray_*.json)
  (cd "$repo" && python3 measurements/bench_ray_serve.py --report "${done_[@]}" --out $W/ray_serve.json) | tail -6
}

case "${1:?expected check, install, join, start, stop, run or status}" in
check)  # before anything else: what the session needs, in one call
  python3 - "$W" "$TEXT_DIR" <<'PY'
import importlib, os, shutil, subprocess, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "triton", "transformers", "diffusers", "av", "safetensors", "fastapi", "uvicorn", "multipart",
             "openai", "k6fast", "flash_attn.cute", "torchao", "ray"):
    try:
        print(f"  {name:13} {getattr(importlib.import_module(name), '__version__', 'present')}")
    except Exception as exc:  # a missing or broken package is what this reports
        print(f"  {name:13} MISSING ({type(exc).__name__}: {str(exc)[:100]})")
os.makedirs(sys.argv[1], exist_ok=True)
for path in (sys.argv[1], os.path.dirname(sys.argv[2]), "/tmp"):
    total, _, free = shutil.disk_usage(path)
    print(f"  {path}: {free / 1e9:.1f} GB free of {total / 1e9:.1f}")
info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
print("  memory:", info["MemTotal"].strip(), "total,", info["MemAvailable"].strip(), "available")
# Bytecode: a process that finds no .pyc and may not write one compiles every module it imports (seconds per process;
# measurements/sessions/2026-12-02_imports-cpu). `install` compiles /tmp/site; this says what the environment has.
torch_dir = os.path.dirname(importlib.import_module("torch").__file__)
print("  PYTHONDONTWRITEBYTECODE:", os.environ.get("PYTHONDONTWRITEBYTECODE", "unset"),
      "| torch has bytecode:", os.path.isdir(os.path.join(torch_dir, "__pycache__")))
smi = shutil.which("nvidia-smi")
query = [smi or "nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv,noheader"]
print("  GPU:", subprocess.run(query, capture_output=True, text=True).stdout.strip() if smi else "no nvidia-smi")
PY
  ;;
install)
  mkdir -p $W $SITE
  [ "${3:-}" = --self ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-build-isolation \
    --target $SITE "$repo"
  # Wheels are unpacked rather than pip-installed: `pip --target` refuses to merge a wheel into a folder another wheel
  # made (the CuTe DSL's cu13 libraries go into nvidia_cutlass_dsl/, protobuf and google-auth share google/). The
  # unpacking keeps executable bits (ray's raylet) and moves a wheel's .data/purelib and platlib into place.
  shopt -s nullglob
  python3 - $SITE "${2:?wheel dir}"/*.whl <<'PY'
import os, shutil, sys, zipfile
site = sys.argv[1]
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts, headers, data: nothing the runtime imports
                parts = parts[2:]
            dest = os.path.join(site, *parts)
            if info.is_dir():
                os.makedirs(dest, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(dest, mode)
    print("unpacked", os.path.basename(wheel))
PY
  # Bytecode, as `pip install` leaves it for a user: without it (`--no-compile`, unpacked wheels, and a machine where
  # PYTHONDONTWRITEBYTECODE is set) every process compiles what it imports from source. Up-to-date files are skipped.
  python3 -m compileall -q -j 0 $SITE > /dev/null 2>&1 || echo "compileall: some files did not compile (exit $?)"
  # The machine's own packages too, once (--self): the 2026-12-02 lease's processes each compiled ≈ 2,440 modules of
  # torch, sympy, triton and others from source (its sidecars' process.bytecode), which a user's install has compiled.
  if [ "${3:-}" = --self ]; then
    own=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    if [ -w "$own" ]; then
      python3 -m compileall -q -j 0 "$own" > /dev/null 2>&1; echo "compiled the bytecode of $own (exit $?)"
    else
      echo "$own is read-only: its packages stay without bytecode"
    fi
  fi
  ;;
join)
  name=${2:?wheel name}
  cat $W/"$name".part* > "$W/$name"
  mkdir -p $W/joined && mv "$W/$name" $W/joined/ && bash "$0" install $W/joined && rm -rf $W/joined
  touch "$W/${3:?ready marker}"
  ;;
start)
  shift
  mkdir -p $W
  setsid nohup bash "$repo/measurements/acceptance_lease.sh" run "$@" > $W/run.log 2>&1 < /dev/null &
  echo $! > $W/daemon.pid  # setsid: the daemon leads its own process group, which `stop` ends
  echo "started $!"
  ;;
stop)  # end the daemon and everything it started (a step's processes included); the checkpoint writer too
  [ -f $W/daemon.pid ] && kill -- -"$(cat $W/daemon.pid)" 2>/dev/null
  rm -f $W/daemon.pid
  echo "stopped at step: $(cat $W/current_step 2>/dev/null || echo none)"
  ;;
run)
  shift
  mkdir -p $W
  if [ ! -f $W/synthetic.done ]; then
    (write_checkpoint > $W/synthetic.log 2>&1; touch $W/synthetic.done) &
  fi
  for s in "$@"; do
    echo "$s" > $W/current_step  # what a polling call reads (never `pgrep -f`: it matches the call's own command)
    step "$s"
    case "$s" in
    gpu-tests) gpu_tests ;;
    attention) attention ;;
    acceptance:*) acceptance "${s#acceptance:}" ;;
    page-cache) checkpoint; time cat $W/syn/*/*.safetensors $W/syn/*.safetensors > /dev/null 2>&1 ;;
    serve:*) IFS=: read -r _ arm budget jobs <<< "$s"; serve_bench "$arm" "$budget" "$jobs" ;;
    ray:*) IFS=: read -r _ config n <<< "$s"; ray_bench "$config" "$n" ;;
    block)
      (cd "$repo" && timeout 300 python3 measurements/bench_block_arms.py --no-diffusers --repeats 4 \
        --variants fused+compile,fused+compile+fa4exact --out $W/block_arms.json \
        > $W/block_arms.log 2>&1); tail -8 $W/block_arms.log ;;
    profile:*)
      checkpoint
      arm=${s#profile:}
      (cd "$repo" && timeout 420 python3 measurements/profile_step.py --model $W/syn --arm "$arm" \
        --geometry "$GEOMETRY" --warmup-requests 0 --budget-gb 32 --out $W/profile_$arm.json \
        > $W/profile_$arm.log 2>&1); echo "profile exit $?"; tail -30 $W/profile_$arm.log ;;
    compile-diag)
      checkpoint
      sed 's/^K6_COMPILE=0$/K6_COMPILE=1/' "$repo/switches/arms/fast.env" > $W/fast-compiled.env
      (cd /tmp && TORCH_LOGS=recompiles,graph_breaks K6_INDUCTOR_CACHE_DIR=$W/diag-cache K6_VRAM_BUDGET_GB=32 \
        K6_PIFLOW_CACHE_STEPS= timeout 240 python3 -m k6fast.cli generate --model $W/syn --arm $W/fast-compiled.env \
        --prompt "a diagnostic" --size 256x256 --frames 9 --steps 3 --out $W/diag.mp4) > $W/diag_compile.log 2>&1
      echo "diagnostic exit $?"; grep -c "Recompiling" $W/diag_compile.log ;;
    peer-checkpoint) peer_checkpoint ;;
    text-phase)
      checkpoint
      (cd "$repo" && timeout 300 python3 measurements/bench_text_phase.py --model $W/syn --out $W/text_phase.json \
        --prompts 3 --dit-resident-gb 17 --breakdown > $W/text_phase.log 2>&1); echo "text phase exit $?"
      tail -4 $W/text_phase.log ;;
    decode-probe)
      checkpoint
      for keep in "" --keep-mapped; do
        (cd "$repo" && timeout 300 python3 measurements/probe_decode_first_call.py --model $W/syn --budget-gb 32 \
          --hold-gb 19 $keep --out $W/decode_probe${keep:+_kept}.json >> $W/decode_probe.log 2>&1)
        echo "decode probe $keep exit $?"
      done
      tail -40 $W/decode_probe.log ;;
    decode-profile)
      (cd "$repo" && timeout 300 python3 measurements/profile_video_decode.py --out $W/profile_decode.json \
        > $W/profile_decode.log 2>&1); echo "decode profile exit $?"; tail -12 $W/profile_decode.log ;;
    first-step:*)
      checkpoint
      arm=${s#first-step:}
      (cd "$repo" && timeout 300 python3 measurements/profile_first_step.py --model $W/syn --arm "$arm" \
        --cache-dir $W/work/cache/$arm --geometry "$GEOMETRY" --out $W/first_step_$arm.txt \
        > $W/first_step_$arm.log 2>&1); echo "first-step profile exit $?"; head -4 $W/first_step_$arm.txt ;;
    dit-ahead:*)
      checkpoint
      IFS=: read -r _ arm pairs <<< "$s"
      (cd "$repo" && timeout 900 python3 measurements/bench_dit_ahead.py --model $W/syn --arm "$arm" \
        --cache-dir $W/work/cache/$arm --geometry "$GEOMETRY" --pairs "${pairs:-2}" --out $W/dit_ahead_$arm.json \
        > $W/dit_ahead_$arm.log 2>&1); echo "dit-ahead exit $?"; tail -3 $W/dit_ahead_$arm.log ;;
    calibrate:*)
      checkpoint
      IFS=: read -r _ arm geometry <<< "$s"
      IFS=x read -r cw ch cf <<< "$geometry"
      (cd /tmp && env ${CALIBRATE_BUDGET_GB:+K6_VRAM_BUDGET_GB=$CALIBRATE_BUDGET_GB} K6_STEP_CACHE=calibrate \
        timeout 900 python3 -m k6fast.cli generate \
        --model $W/syn --arm "$arm" --prompt "a calibration run" --size "${cw}x${ch}" --frames "$cf" \
        --out $W/calibration_$arm.mp4) > $W/calibration_$arm.log 2>&1
      echo "calibration $arm exit $?"; tail -3 $W/calibration_$arm.log; ls $W/syn/k6fast-step-cache 2>/dev/null ;;
    tune)
      checkpoint
      rm -rf $W/tune
      (cd "$repo" && LEASE_DIR=$W GEOMETRY=${TUNE_GEOMETRY:-480x272x49} timeout "${TUNE_TIMEOUT:-900}" \
        bash measurements/run_tune.sh $W/tune ${TUNE_ARGS:-} > $W/tune.log 2>&1); echo "tune exit $?"; tail -20 $W/tune.log ;;
    drop-text)
      if [ -f $W/text.linked ]; then echo "drop-text: $W/syn-df11 links into $TEXT_DIR; it stays"; continue; fi
      rm -rf "$TEXT_DIR"; echo "removed $TEXT_DIR" ;;
    df11-checkpoint)
      checkpoint
      rm -rf "$DF11_DIR"
      (cd /tmp && time timeout 1200 python3 -m k6fast.cli quantize --format df11 --device "$DF11_DEVICE" \
        $W/syn "$DF11_DIR") \
        > $W/df11_checkpoint.log 2>&1
      code=$?; echo "df11 checkpoint exit $code"; tail -4 $W/df11_checkpoint.log
      # Only a finished copy makes the later acceptance steps add --df11-model (they would all refuse without one).
      if [ $code = 0 ] && [ -f "$DF11_DIR/model_index.json" ]; then
        du -sh "$DF11_DIR/transformer"; echo "$DF11_DIR" > $W/df11.path
      fi ;;
    df11-to-disk)
      # Never deletes the BF16 DiT without a finished compressed copy to move in its place.
      if [ ! -f $W/df11.path ] || [ "$(cat $W/df11.path)" != "$DF11_DIR" ] || [ ! -f "$DF11_DIR/model_index.json" ]; then
        echo "df11-to-disk: no finished copy in $DF11_DIR; the BF16 DiT stays"; continue
      fi
      rm -f $W/syn/transformer/*.safetensors && rm -rf $W/syn-df11 && mkdir -p $W/syn-df11
      for entry in "$DF11_DIR"/*; do
        name=$(basename "$entry")
        case "$name" in
        text_encoder | text_encoder_2) ;;
        *) mv "$entry" $W/syn-df11/ ;;
        esac
      done
      # The text encoders go to the disk too where they fit with 3 GB to spare, as a user's are (then drop-text frees
      # their RAM, and the ballast leaves its 60 GB to the page cache and the process): else links into $TEXT_DIR.
      text_bytes=$(du -sbL "$DF11_DIR"/text_encoder "$DF11_DIR"/text_encoder_2 | awk '{n += $1} END {print n}')
      room=$(df --output=avail -B1 $W | tail -1)
      for name in text_encoder text_encoder_2; do
        if [ "$room" -gt $((text_bytes + 3000000000)) ]; then
          cp -rL "$DF11_DIR/$name" $W/syn-df11/$name
        else
          ln -s "$(readlink -f $W/syn/$name)" $W/syn-df11/$name && touch $W/text.linked
        fi
      done
      rm -rf "$DF11_DIR"; echo $W/syn-df11 > $W/df11.path; du -shL $W/syn-df11/*; df -h $W | tail -1 ;;
    df11)
      (cd "$repo" && timeout 240 python3 measurements/bench_df11.py ${DF11_ARGS:-} --out $W/df11.json \
        > $W/df11.log 2>&1); echo "df11 exit $?"; tail -20 $W/df11.log ;;
    *) echo "unknown step $s" ;;
    esac
  done
  step done
  echo done > $W/current_step
  touch $W/done
  ;;
status)
  out=${2:?output folder}
  tail -25 $W/run.log
  for f in $REC/runs.jsonl $REC/README.md $REC/acceptance.json $W/exact_attention.json $W/sparse_attention.json \
    $W/block_arms.json $W/ray_serve.json $W/profile_*.json $W/text_phase.json $W/df11.json \
    $W/decode_probe*.json $W/first_step_*.txt $W/dit_ahead_*.json $W/tune/tune.json $W/tune/tuned.env; do
    [ -f "$f" ] && cp "$f" "$out/"
  done
  for f in $REC/serve/*.json; do [ -f "$f" ] && cp "$f" "$out/serve_$(basename "$f")"; done
  (cd $W && tar czf "$out/logs.tgz" $(ls run.log pytest_gpu*.log synthetic.log diag_compile.log *_attention.log \
    block_arms.log profile_*.log ray_*.log ray_*.json serve_*.log work/serve-*/server.log record/commit.txt \
    text_phase.log decode_probe.log first_step_*.log dit_ahead_*.log calibration_*.log calibration_*.json tune.log df11.log df11_checkpoint.log peer_checkpoint.log \
    work/runs/*/stderr.log work/runs/*/*.json 2>/dev/null))
  ls $W/done 2>/dev/null && echo "session finished"
  ;;
*)
  echo "expected check, install, join, start, stop, run or status" >&2
  exit 2
  ;;
esac
