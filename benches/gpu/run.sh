#!/usr/bin/env bash
# Runs what benches/gpu/pack.sh built, on a GPU machine without Rust, from the root of
# a checkout of the same commit with target/gpu-pack/kiln-gpu.tar.xz in it:
#
#   benches/gpu/run.sh tests [NAME]     # the CUDA test suites and the digits example (or the
#                                       # suites whose name holds NAME)
#   benches/gpu/run.sh bench [ARGS]     # the harness with --device cuda (add --rounds 3 --write)
#   benches/gpu/run.sh ops              # the fused ops' CUDA kernels against torch compositions
#   benches/gpu/run.sh cli [MODEL_DIR]  # the `kiln` CLI on cuda:0: precisions, the profiler, the
#                                       # strategies on NCCL at world size 1, activation checkpointing, and
#                                       # generation (MODEL_DIR: make_tiny_llama.py's output)
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
    for t in "$bin"/test-*"${2:-}"*; do
      echo "=== ${t##*/}"
      "$t" --test-threads=1 || status=1
    done
    if [ -z "${2:-}" ]; then
      echo "=== digits --model cnn --device cuda:0"
      "$bin/digits" --model cnn --device cuda:0 || status=1
    fi
    exit $status
    ;;
  bench)
    shift
    exec "$bin/compare" --device cuda "$@"
    ;;
  ops)
    exec "$bin/cuda_ops"
    ;;
  cli)
    status=0
    runs=target/tmp/gpu-cli
    rm -rf "$runs" && mkdir -p "$runs"
    # The last epoch's validation accuracy of a run directory, checked against a floor.
    accuracy() {
      awk -F, -v floor="$2" 'NR == 1 {for (i = 1; i <= NF; i++) if ($i == "val_accuracy") c = i}
        END {printf "  %s: val_accuracy %s\n", FILENAME, $c; exit !($c + 0 >= floor)}' "$1/epochs.csv"
    }
    train() {  # NAME CONFIG ARGS...
      local name=$1 config=$2
      shift 2
      echo "=== kiln train $name"
      if "$bin/kiln" train --config "$config" --device cuda:0 --epochs 4 --output "$runs/$name" \
          --no-progress "$@" >"$runs/$name.log" 2>&1 && accuracy "$runs/$name" 0.9; then
        echo "  ok"
      else
        tail -n 15 "$runs/$name.log"; status=1
      fi
    }
    base=examples/configs/digits-cnn.toml
    for precision in 32-true 16-mixed bf16-mixed bf16-true; do
      train "$precision" "$base" --precision "$precision"
    done
    # The profiler on cuda:0: Kineto records the CUDA kernels beside the operators.
    train profile "$base" --profile steps=5..10
    if grep -q "Self device" "$runs/profile/profile/ops.txt" 2>/dev/null; then
      head -n 14 "$runs/profile/profile/ops.txt"
    else
      echo "  no device time in $runs/profile/profile/ops.txt"; status=1
    fi
    for strategy in ddp zero1 zero2 fsdp; do
      config=$runs/$strategy.toml
      { echo 'activation_checkpointing = ["0", "3"]'; cat "$base"
        printf '\n[distributed]\nbackend = "nccl"\nstrategy = "%s"\n' "$strategy"; } >"$config"
      echo "=== kiln launch --nproc-per-node 1 (NCCL, $strategy, activation checkpointing)"
      if "$bin/kiln" launch --nproc-per-node 1 -- train --config "$config" --device cuda:0 \
          --epochs 4 --output "$runs/$strategy" --no-progress >"$runs/$strategy.log" 2>&1 \
          && accuracy "$runs/$strategy" 0.9; then
        echo "  ok"
      else
        tail -n 15 "$runs/$strategy.log"; status=1
      fi
    done
    model=${2:-}
    if [ -n "$model" ]; then
      # Greedy generation on cuda:0 against the CPU's, with and without the cache, and
      # against transformers' generate on the GPU.
      for prompt in 1,17,29,41 1,5; do
        cpu=$("$bin/kiln" generate --model "$model" --prompt-ids "$prompt" --max-new-tokens 24 --device cpu)
        gpu=$("$bin/kiln" generate --model "$model" --prompt-ids "$prompt" --max-new-tokens 24 --device cuda:0)
        nocache=$("$bin/kiln" generate --model "$model" --prompt-ids "$prompt" --max-new-tokens 24 \
          --device cuda:0 --no-cache)
        hf=$("$python" - "$model" "$prompt" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).to("cuda").eval()
ids = torch.tensor([[int(t) for t in sys.argv[2].split(",")]], device="cuda")
out = m.generate(ids, max_new_tokens=24, do_sample=False)
print(",".join(str(t) for t in out[0, ids.shape[1]:].tolist()))
PY
)
        echo "=== kiln generate --prompt-ids $prompt"
        printf '  cpu          %s\n  cuda:0       %s\n  no cache     %s\n  transformers %s\n' \
          "$cpu" "$gpu" "$nocache" "$hf"
        if [ -n "$gpu" ] && [ "$gpu" = "$cpu" ] && [ "$gpu" = "$nocache" ] && [ -n "$hf" ] && [[ "$gpu" == *"$hf" ]]; then
          echo "  ok"
        else
          status=1
        fi
      done
      # LoRA fine-tuning on cuda:0 in bf16-mixed, and its adapter answering on the GPU.
      mkdir -p models && ln -sfn "$(cd "$model" && pwd)" models/tiny-llama
      echo "=== kiln train lora-llama.toml (cuda:0, bf16-mixed)"
      if "$bin/kiln" train --config examples/configs/lora-llama.toml --device cuda:0 \
          --precision bf16-mixed --output "$runs/lora" --no-progress >"$runs/lora.log" 2>&1; then
        tail -n 2 "$runs/lora/epochs.csv"
        "$bin/kiln" generate --model models/tiny-llama --adapter "$runs/lora/adapter" \
          --prompt $'### Question:\nWhere does the old fox sleep?\n\n### Answer:\n' --max-new-tokens 12 --device cuda:0 || status=1
      else
        tail -n 15 "$runs/lora.log"; status=1
      fi
    fi
    exit $status
    ;;
  *)
    echo "usage: benches/gpu/run.sh tests | bench [ARGS] | ops | cli [MODEL_DIR]" >&2
    exit 2
    ;;
esac
