# Sourced by the device scripts: $out (= $OUT, else ./device-out), the carried wheels installed into /tmp/site and
# put on PYTHONPATH/PATH, the GPU named. Exits the calling script when the wheels do not install. A `blockspec serve`
# left by an earlier call of a warm machine (a benchmark cut by its call's limit) is stopped first: it would hold the
# GPU's memory. NOTE: the pattern must not match this shell's own command line (`pkill -f blockspec` did).
out=${OUT:-device-out}
mkdir -p "$out"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 \
    | grep -v "already exists" || true
PYTHONPATH=/tmp/site python3 -c "import fastapi, zmq, msgspec, aiohttp" 2>/dev/null || { echo "the carried wheels did not install" >&2; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
if pgrep -f "blockspec[.]serve" > /dev/null; then
    echo "stopping a server left by an earlier call: $(pgrep -f 'blockspec[.]serve' | tr '\n' ' ')" >&2
    pkill -f "blockspec[.]serve"
    sleep 5
    pkill -9 -f "blockspec[.]serve" || true
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
