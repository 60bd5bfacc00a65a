#!/usr/bin/env bash
# The serving packages the device machine lacks (it has torch, transformers, tokenizers and jinja2, not fastapi,
# uvicorn, pyzmq or msgpack), as wheels for its Python 3.12, into .whl/ (git-ignored through .git/info/exclude), so
# that gpu_check.sh's `frontend` step can run `gpuformers serve`'s front end there (16 cores). The versions are the
# ones tested here. A device call then names `.whl` and `.cache/assets/qwen3-tokenizer` in carry and starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#       && export PYTHONPATH=/tmp/site:src
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
           manylinux_2_5_x86_64; do
    platforms+=(--platform "${tag}")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.3 anyio==4.16.0 idna==3.21 \
    sniffio==1.3.1 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 pyzmq==27.3.0 msgpack==1.2.4 psutil==7.2.2 \
    httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.19.post1 typing_extensions==4.16.0
du -sh .whl
