#!/usr/bin/env bash
# Fetch, on a CPU host with a package registry, what bench/gpu_check.sh needs on a GPU host without one:
# the CUDA Mooncake wheel and msgspec (for the GPU host's Python, $GPU_PYTHON, default this host's), and
# the system libraries Mooncake links that a bare image may lack, into an ignored folder (at most 64 MiB:
# it travels with the repository). Nothing here is committed.
#
#   bench/gpu_check_prepare.sh [DIR]        # DIR default: bench/.gpu_bundle
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-bench/.gpu_bundle}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
GPU_PYTHON="${GPU_PYTHON:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
MOONCAKE_WHEEL="${MOONCAKE_WHEEL:-mooncake-transfer-engine-cuda13==0.3.14}"
LIMIT=$((64 << 20))

rm -rf "$DIR" && mkdir -p "$DIR/wheels"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" \
    --platform manylinux_2_28_x86_64 --dest "$DIR/wheels" "$MOONCAKE_WHEEL" msgspec

# Mooncake's own libraries ship in the wheel; these are the system ones it links (rdma-core, numa, curl
# and theirs), glibc and the C++ runtime excepted. Taken from this host: gpu_check.sh uses them only
# when Mooncake does not import with the GPU host's own.
unpacked="$(mktemp -d)"
trap 'rm -rf "$unpacked"' EXIT
"$PY" -m zipfile -e "$DIR"/wheels/mooncake_*.whl "$unpacked"
libs="$(for f in "$unpacked"/mooncake/engine.so "$unpacked"/mooncake/_store*.so "$unpacked"/mooncake/mooncake_master; do
          LD_LIBRARY_PATH="$(echo "$unpacked"/*.libs)" ldd "$f"; done \
        | awk '$3 ~ /^\// {print $3}' | grep -v "$unpacked" \
        | grep -Ev '/(libc|libm|libpthread|libdl|librt|libresolv|libgcc_s|libstdc\+\+|libcuda|libcudart)\.so' | sort -u)"
mkdir -p "$unpacked/lib"
for lib in $libs; do cp -L "$lib" "$unpacked/lib/"; done
tar -czf "$DIR/syslibs.tar.gz" -C "$unpacked" lib
echo "$GPU_PYTHON" > "$DIR/python-version"

size=$(du -sb "$DIR" | cut -f1)
if [ "$size" -gt "$LIMIT" ]; then
    echo "gpu_check_prepare: $DIR holds $size bytes, over the 64 MiB that travel with the repository" >&2
    exit 1
fi
echo "gpu_check_prepare: $DIR ready ($size bytes, Python $GPU_PYTHON): $(ls "$DIR/wheels" | tr '\n' ' ')"
