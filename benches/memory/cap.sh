#!/usr/bin/env bash
# The largest model Kiln trains under a fixed memory cap per rank, under DDP
# and under full sharding (issue 40's demonstration, BENCHMARKS.md (n)).
#
# Each job is two ranks (`kiln launch --nproc-per-node 2`) in a cgroup (v1
# memory controller) capped at 2 x CAP_MIB, swap included where the kernel
# accounts it: a rank that goes over is killed, and the job fails. The model
# is an MLP on the digits, 64 -> H -> (H -> H) x 6 -> 10 (about 6 H^2
# parameters), trained 3 steps with Adam; under FSDP every linear layer is a
# unit. Freed host memory goes back to the system (`retain_host_memory =
# false`, glibc's mmap threshold fixed), or the allocator would keep the whole
# model FSDP frees after sharding it.
#
#   sudo benches/memory/cap.sh [CAP_MIB] [H...]     # needs root for the cgroup
#
# Prints, per strategy and width, whether the job trained and the cgroup's
# peak (both ranks together).
set -euo pipefail
cd "$(dirname "$0")/../.."
cap_mib=${1:-1024}
shift || true
widths=("$@")
if [ ${#widths[@]} -eq 0 ]; then
  widths=(1024 1536 2048 2560 3072 3584 4096)
fi
kiln=${KILN:-target/release/kiln}
[ -x "$kiln" ] || { echo "no $kiln: cargo xtask cargo build --release --bin kiln" >&2; exit 1; }
cgroups=/sys/fs/cgroup/memory
[ -d "$cgroups" ] || { echo "no cgroup v1 memory controller at $cgroups" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"; rmdir "$cgroups"/kiln-cap-* 2>/dev/null || true' EXIT

config() { # strategy width
  local layers="{ type = \"linear\", in_features = 64, out_features = $2 }, { type = \"relu\" },"
  local units="\"0\""
  for i in 1 2 3 4 5 6; do
    layers+=" { type = \"linear\", in_features = $2, out_features = $2 }, { type = \"relu\" },"
    units+=", \"$((2 * i))\""
  done
  layers+=" { type = \"linear\", in_features = $2, out_features = 10 }"
  units+=", \"14\""
  cat <<EOF
seed = 1
output_dir = "runs/memory-cap"
[data]
dataset = "digits"
batch_size = 16
drop_last = true
workers = 1
scale = 16.0
[model]
type = "sequential"
layers = [ $layers ]
[loss]
type = "cross_entropy"
[optimizer]
type = "adam"
lr = 0.0001
[training]
epochs = 1
max_steps = 3
log_every = 1
retain_host_memory = false
[distributed]
backend = "gloo"
strategy = "$1"
[logging]
tensorboard = false
plots = false
progress = false
EOF
  if [ "$1" = fsdp ]; then
    printf '[distributed.fsdp]\nunits = [%s]\n' "$units"
  fi
}

printf '%-6s %6s %12s %8s %14s\n' strategy H parameters trained "peak MiB (2 ranks)"
for strategy in ddp fsdp; do
  for h in "${widths[@]}"; do
    config "$strategy" "$h" > "$work/$strategy-$h.toml"
    group="$cgroups/kiln-cap-$strategy-$h"
    mkdir "$group"
    echo $((2 * cap_mib * 1024 * 1024)) > "$group/memory.limit_in_bytes"
    if [ -f "$group/memory.memsw.limit_in_bytes" ]; then
      echo $((2 * cap_mib * 1024 * 1024)) > "$group/memory.memsw.limit_in_bytes" || true
    fi
    if bash -c "echo \$\$ > '$group/cgroup.procs' && exec env MALLOC_MMAP_THRESHOLD_=131072 \
        RUST_LOG=error '$kiln' launch --nproc-per-node 2 -- train --config '$work/$strategy-$h.toml' \
        --output '$work/run-$strategy-$h'" > "$work/$strategy-$h.log" 2>&1; then
      trained=yes
    else
      trained=no
      grep -m1 -E "killed|error" "$work/$strategy-$h.log" | sed 's/^/    /' >&2 || true
    fi
    peak=$(($(cat "$group/memory.max_usage_in_bytes") / 1024 / 1024))
    params=$((64 * h + h + 6 * (h * h + h) + 10 * h + 10))
    printf '%-6s %6d %12d %8s %14d\n' "$strategy" "$h" "$params" "$trained" "$peak"
    rmdir "$group" 2>/dev/null || true
    rm -rf "$work/run-$strategy-$h"
  done
done
