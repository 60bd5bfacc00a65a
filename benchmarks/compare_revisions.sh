#!/usr/bin/env bash
# Runs one benchmark against two revisions of the library in the same session, alternating, so that "before" and
# "after" share the machine's state: the benchmark script is this checkout's, the gpuformers it imports is the
# revision's src/ (PYTHONPATH). Output goes to stdout, each run headed by its revision.
#
#   bash benchmarks/compare_revisions.sh <before-rev> <after-rev|WORKTREE> <rounds> -- python benchmarks/bench_x.py ...
#
# e.g. bash benchmarks/compare_revisions.sh 5f5da7e WORKTREE 1 -- python benchmarks/bench_generate.py --threads 1
set -euo pipefail
before="$1"; after="$2"; rounds="$3"; shift 3
[ "$1" = "--" ] && shift
root="$(cd "$(dirname "$0")/.." && pwd)"
scratch="$(mktemp -d)"
trap 'rm -rf "${scratch}"' EXIT
tree() {  # rev -> a folder holding that revision's src/
    if [ "$1" = "WORKTREE" ]; then echo "${root}/src"; return; fi
    mkdir -p "${scratch}/$1" && git -C "${root}" archive "$1" src | tar -x -C "${scratch}/$1"
    echo "${scratch}/$1/src"
}
src_before="$(tree "${before}")"
src_after="$(tree "${after}")"
for round in $(seq 1 "${rounds}"); do
    for side in before after; do
        if [ "${side}" = before ]; then rev="${before}" src="${src_before}"; else rev="${after}" src="${src_after}"; fi
        echo "=== round ${round}: ${side} (${rev}) $(date -u +%H:%M:%S) ==="
        (cd "${root}" && PYTHONPATH="${src}" "$@")
    done
done
