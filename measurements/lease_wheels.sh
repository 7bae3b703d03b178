#!/usr/bin/env bash
# The wheels an H200 lease carries (acceptance_lease.sh's header lists what the GPU machine lacks), downloaded for its
# Python 3.12 and laid out for the three calls that start a lease, each under the 64 MiB a call may carry together
# with the working tree (about 9 MB of tracked files):
#   .whl/a  av, diffusers, accelerate, psutil, importlib_metadata, zipp, flash-attn-4 and its pure-Python and small
#           native needs (nvidia-cutlass-dsl, -libs-base, -libs-core, apache-tvm-ffi, torch-c-dlpack-ext,
#           quack-kernels, einops): call 1, `lease_envelope.sh start`
#   .whl/b  torchao and the first half of nvidia-cutlass-dsl-libs-cu13 (92 MB): call 2, `acceptance_lease.sh install`
#   .whl/c  the server's wheels (fastapi, uvicorn, python-multipart, openai, with their dependencies: fastapi imports
#           opentelemetry, openai httpx2) and the second half: call 3, `install`, then `join cu13.whl fa4.ready`
# Run from the repository root on a machine with PyPI; .whl/ is ignored by git.
#   bash measurements/lease_wheels.sh
set -euo pipefail
out=.whl
tmp=$(mktemp -d)
platforms=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform any)
get() { python3 -m pip download -q "${platforms[@]}" "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
rm -rf $out && mkdir -p $out/a $out/b $out/c
get --no-deps -d $out/a av==18.1.0 diffusers==0.42.1 accelerate==1.15.0 psutil importlib_metadata zipp einops \
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi torch-c-dlpack-ext quack-kernels
get --no-deps -d $out/b torchao==0.18.0
get --no-deps -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
(cd "$tmp" && split -b 45m nvidia_cutlass_dsl_libs_cu13-*.whl cu13.part)
mv "$tmp/cu13.partaa" $out/b/ && mv "$tmp/cu13.partab" $out/c/
[ ! -e "$tmp/cu13.partac" ] || { echo "the cu13 wheel split into more than two parts" >&2; exit 1; }
get -d $out/c fastapi uvicorn python-multipart openai
rm -rf "$tmp"
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
for call in a b c; do
  bytes=$(du -cb $out/$call | tail -1 | cut -f1)
  [ $call = a ] && bytes=$((bytes + 4000000))  # src.tgz, the `git archive` call 1 carries beside .whl/a
  echo "$out/$call: $((bytes / 1000000)) MB + the tree's $((tree / 1000000)) MB"
  [ $((bytes + tree)) -lt $((64 << 20)) ] || { echo "$out/$call is over what a call carries" >&2; exit 1; }
done
