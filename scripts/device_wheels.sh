#!/usr/bin/env bash
# Here (not on the device): downloads into .whl the wheels the device's python3 lacks for blockspec's server,
# benchmarks and GPU tests (the device image has torch, triton, transformers, numpy, aiohttp, httpx, anyio's deps,
# prometheus-client, ...; ../.library/device/KINDS.md lists them). A fresh checkout has no .whl (it is git-ignored),
# so run this once per session before the first device call that carries .whl. ≈ 7.3 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl  # NOTE: one version of each package: device_env.sh installs .whl/*.whl (.gitignore lists /.whl/)
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
# NOTE: pinned to the set the H200 ran on 2026-12-03 (GPU tests, servers, py-spy); --no-deps, so every missing need is named; fastapi and pydantic want newer anyio / typing-extensions /
# annotated-doc than the image's, and dflash is the GPU tests' oracle.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 annotated-doc==0.0.7 anyio==4.16.0 opentelemetry-api==1.45.2 \
    pyzmq==27.3.0 msgspec==0.23.0 gguf==0.19.0 py-spy==0.4.3 dflash==0.1.0
ls .whl
du -sh .whl
