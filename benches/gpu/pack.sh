#!/usr/bin/env bash
# Builds what a GPU run needs for a machine that has PyTorch 2.11 (CUDA) in its Python
# but no Rust toolchain: the benchmark harness, the fused ops' CUDA benchmark, the CUDA
# test suites and the digits example, built here against the project's libtorch 2.11.0 with the `cuda` feature
# and without TensorFlow. Writes target/gpu-pack/kiln-gpu.tar.xz (stripped binaries,
# kiln-fused-ops' shared libraries and a manifest); copy it into a checkout of the same
# commit on the GPU machine and run benches/gpu/run.sh there.
#
# usage: benches/gpu/pack.sh          (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/gpu-pack
rm -rf "$out"
mkdir -p "$out/kiln-gpu/bin"
json="$out/build.jsonl"
: >"$json"
build() { cargo xtask cargo "$@" --message-format=json-render-diagnostics >>"$json"; }
build bench --bench compare --no-default-features --features torch,cuda,text,vision --no-run
build test -p kiln-fused-ops --no-default-features --features cuda --no-run
build bench -p kiln-fused-ops --bench cuda_ops --no-default-features --features cuda --no-run
build test -p kiln-torch --features cuda --no-run
build test -p kiln-c10d --features cuda --no-run
build build --release --example digits --no-default-features --features torch,cuda
build build --release --bin kiln --no-default-features --features torch,cuda,text,vision
python3 - "$json" "$out/kiln-gpu" "$PWD" <<'PY'
import json, os, shutil, subprocess, sys

messages, dest, workspace = sys.argv[1], sys.argv[2], sys.argv[3]
# The suites with CUDA parts (the others need no GPU and run in CI).
TESTS = {"kiln-fused-ops": {"cuda", "torch_ops"},
         "kiln-torch": {"convert", "cuda", "cuda_graph", "grad_scaler", "layer_parity",
                       "losses_and_state", "optim_parity", "torchscript", "torchscript_export"},
         "kiln-c10d": {"distributed"}}


def package_name(package_id):
    # "path+file:///dir#name@version", or "path+file:///name#version"
    location, _, fragment = package_id.partition("#")
    return fragment.split("@")[0] if "@" in fragment else location.rstrip("/").rsplit("/", 1)[-1]


manifest = [f"workspace {workspace}"]
for line in open(messages):
    msg = json.loads(line)
    package = package_name(msg.get("package_id", ""))
    if msg.get("reason") == "build-script-executed" and package == "kiln-fused-ops":
        for key, value in msg["env"]:
            if key == "KILN_FUSED_OPS_TORCH_LIBRARY":
                name = value.split("/build/")[1].split("/")[0] + ".so"
                shutil.copy(value, os.path.join(dest, "bin", name))
                if f"lib {name} {value}" not in manifest:
                    manifest.append(f"lib {name} {value}")
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    kind, target = msg["target"]["kind"][0], msg["target"]["name"]
    if kind in ("bench", "example", "bin"):
        name = target
    elif kind == "test" and target in TESTS.get(package, ()):
        name = f"test-{package}-{target}"
    else:
        continue
    subprocess.run(["strip", "-o", os.path.join(dest, "bin", name), msg["executable"]], check=True)
    manifest.append(f"bin {name}")
with open(os.path.join(dest, "manifest.txt"), "w") as f:
    f.write("\n".join(manifest) + "\n")
print("\n".join(manifest))
PY
cp -L .kiln/data/digits.csv.gz "$out/kiln-gpu/"
tar -C "$out" -cJf "$out/kiln-gpu.tar.xz" kiln-gpu
ls -l "$out/kiln-gpu.tar.xz"
