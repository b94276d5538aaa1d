# Sourced by the device scripts: $out (= $OUT, else ./device-out), the carried wheels installed into /tmp/site and
# put on PYTHONPATH/PATH, the GPU named. Exits the calling script when the wheels do not install.
out=${OUT:-device-out}
mkdir -p "$out"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 \
    | grep -v "already exists" || true
PYTHONPATH=/tmp/site python3 -c "import fastapi, zmq, msgspec, aiohttp" 2>/dev/null || { echo "the carried wheels did not install" >&2; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
