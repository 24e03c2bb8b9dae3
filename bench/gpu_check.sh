#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on a GPU host without a package registry, in at most 10 minutes:
# it unpacks what bench/gpu_check_prepare.sh fetched (no pip, no network), uses the bundled system
# libraries only if Mooncake does not import without them, and writes one JSON report.
#
#   bench/gpu_check.sh [DIR] [OUT]     # DIR: bench/.gpu_bundle; OUT: bench/results/gpu_check.json
# Extra arguments for the module go in $GPU_CHECK_ARGS (e.g. "--skip mooncake_pool" or "--dry-run").
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-bench/.gpu_bundle}"
OUT="${2:-bench/results/gpu_check.json}"
PY="${PYTHON:-python3}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-570}"

site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$DIR/wheels" ]; then
    want="$(cat "$DIR/python-version" 2>/dev/null || echo '?')"
    have="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    [ "$want" = "$have" ] || echo "gpu_check: the bundle is for Python $want, this is $have; Mooncake parts will skip" >&2
    for wheel in "$DIR"/wheels/*.whl; do "$PY" -m zipfile -e "$wheel" "$site"; done
    export PYTHONPATH="$site:$PYTHONPATH"
    if ! "$PY" -c 'import mooncake.engine, mooncake.store' 2>/dev/null && [ -f "$DIR/syslibs.tar.gz" ]; then
        tar -xzf "$DIR/syslibs.tar.gz" -C "$site"
        export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$site/lib"
        echo "gpu_check: Mooncake needs the bundled system libraries ($site/lib)" >&2
    fi
    chmod +x "$site"/mooncake/mooncake_master 2>/dev/null || true
else
    echo "gpu_check: no bundle at $DIR (run bench/gpu_check_prepare.sh on a CPU host); Mooncake parts will skip" >&2
fi
export KVPP_GPU_BUNDLE="$DIR" MC_LOG_LEVEL="${MC_LOG_LEVEL:-ERROR}"
# shellcheck disable=SC2086
exec timeout --kill-after=10 "$BUDGET_S" "$PY" -m bench.gpu_check --out "$OUT" ${GPU_CHECK_ARGS:-}
