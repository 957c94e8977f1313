#!/usr/bin/env bash
# Runs what benches/gpu/pack.sh built, on a GPU machine without Rust, from the root of
# a checkout of the same commit with target/gpu-pack/kiln-gpu.tar.xz in it:
#
#   benches/gpu/run.sh tests            # the CUDA test suites and the digits example
#   benches/gpu/run.sh bench [ARGS]     # the harness with --device cuda (add --rounds 3 --write)
#   benches/gpu/run.sh ops              # the fused ops' CUDA kernels against torch compositions
#
# The binaries were built with absolute paths of the build machine in them (the
# workspace, its target directory, `.kiln/venv`): this recreates them, as links to
# this checkout and to the Python that has torch (PYTHON, else python3), and puts
# that torch's libraries on LD_LIBRARY_PATH.
set -uo pipefail
cd "$(dirname "$0")/../.."
pack=target/gpu-pack
[ -d "$pack/kiln-gpu" ] || tar -C "$pack" -xJf "$pack/kiln-gpu.tar.xz" || exit 1
bin=$PWD/$pack/kiln-gpu/bin
python=${PYTHON:-python3}
read -r prefix torch_dir < <("$python" -c 'import os, sys, torch
print(sys.prefix, os.path.dirname(torch.__file__))') || { echo "no torch in $python" >&2; exit 1; }
export LD_LIBRARY_PATH="$torch_dir/lib:$(dirname "$torch_dir")/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KILN_BENCH_PYTHON=$prefix/bin/python3
workspace=$(awk '$1 == "workspace" {print $2}' "$pack/kiln-gpu/manifest.txt")
if [ "$workspace" != "$PWD" ] && [ ! -e "$workspace" ]; then
  mkdir -p "$(dirname "$workspace")" && ln -s "$PWD" "$workspace"
fi
mkdir -p .kiln/data target/tmp
[ -e .kiln/venv/bin/python ] || { rm -rf .kiln/venv; ln -s "$prefix" .kiln/venv; }
[ -e .kiln/venv/bin/python ] || ln -s python3 "$prefix/bin/python"
[ -e .kiln/data/digits.csv.gz ] || { rm -f .kiln/data/digits.csv.gz; cp "$pack/kiln-gpu/digits.csv.gz" .kiln/data/; }
while read -r kind name path; do
  [ "$kind" = lib ] && mkdir -p "$(dirname "$path")" && cp "$bin/$name" "$path"
done <"$pack/kiln-gpu/manifest.txt"

case "${1:-}" in
  tests)
    status=0
    for t in "$bin"/test-*; do
      echo "=== ${t##*/}"
      "$t" --test-threads=1 || status=1
    done
    echo "=== digits --model cnn --device cuda:0"
    "$bin/digits" --model cnn --device cuda:0 || status=1
    exit $status
    ;;
  bench)
    shift
    exec "$bin/compare" --device cuda "$@"
    ;;
  ops)
    exec "$bin/cuda_ops"
    ;;
  *)
    echo "usage: benches/gpu/run.sh tests | bench [ARGS] | ops" >&2
    exit 2
    ;;
esac
