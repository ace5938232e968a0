#!/usr/bin/env bash
# GPU check of issue 9 (fused Triton expert kernels, pinned arena copies, CUDA bench), for a
# machine with a CUDA GPU, torch (CUDA) + Triton installed, no network, and none of moestream's
# other dependencies. Run from anywhere:  OUT=/some/dir bash .ci/gpu_check.sh [STEP...]
# Steps (default: all, in this order): tests kernels bench-slice bench-tiny. Each has its own
# timeout; the whole run takes ~5-8 minutes on an H200 (most of it the two benchmarks).
# (Kept in the repository; a session lent a GPU fills .dev/whl as below, then `run` with
# command "OUT=$OUT bash .ci/gpu_check.sh", carry [".dev"], timeout ~600.)
#
# Prepared on a machine with network (python 3.12 target):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .dev/whl pyzmq gguf msgpack tokenizers uvloop tqdm pyyaml hypothesis attrs sortedcontainers \
#       pytest pytest-timeout pluggy iniconfig packaging numpy   (numpy installed only where missing)
#   pip wheel --no-deps . -w .dev/whl        # moestream itself (used only if building here fails)
# numba/llvmlite are left out (60 MB, over the 64 MiB a device run carries; no CUDA path imports them).
#
# Writes to $OUT: steps.log (what ran, exit codes), env.txt, nvidia-smi.txt, pip.log, tests.log +
# junit.xml (tests/decoder/test_triton.py, test_cuda.py and test_zero_copy.py on the device), kernels.txt (per-layer
# fused mix vs torch dequantize + matmul on the slice), bench_slice.{json,txt} and
# bench_tiny.{json,txt} (`moestream bench decode --device cuda`).
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/moestream-gpu-out}"
SITE=/tmp/moestream-site
PY="${PYTHON:-python3}"
mkdir -p "$OUT" "$SITE"
cd "$ROOT"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/steps.log"; }
step() {  # step NAME TIMEOUT_S CMD... : run, log the exit code, go on either way
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@"
    log "$name: exit $? in $((SECONDS - t0)) s"
}

STEPS=" ${*:-tests kernels bench-slice bench-tiny} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
log "start in $ROOT, steps:$STEPS"
{ $PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
          "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
  $PY -c 'import triton; print("triton", triton.__version__)'
  $PY -c 'import numpy; print("numpy", numpy.__version__)'
  nproc; free -g; } > "$OUT/env.txt" 2>&1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

# -- dependencies from .dev/whl, into a private target (torch, numpy, triton stay as installed) --
wheels=()
for w in .dev/whl/*.whl; do
    case "$(basename "$w")" in
        moestream-*) ;;
        numpy-*) $PY -c 'import numpy' 2>/dev/null || wheels+=("$w") ;;
        *) wheels+=("$w") ;;
    esac
done
rm -rf /tmp/moestream-wheel
if $PY -m pip wheel --no-deps --no-build-isolation --no-index . -w /tmp/moestream-wheel > "$OUT/pip.log" 2>&1; then
    wheels+=(/tmp/moestream-wheel/moestream-*.whl)
    log "moestream wheel built from this tree"
else
    wheels+=(.dev/whl/moestream-*.whl)
    log "building moestream here failed (see pip.log): installing the prebuilt wheel from .dev/whl (may be stale)"
fi
step pip-install 180 $PY -m pip install --no-index --no-deps --upgrade --target "$SITE" "${wheels[@]}" >> "$OUT/pip.log" 2>&1
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
$PY -c 'import moestream, zmq, gguf, msgpack; print("imports ok:", moestream.__file__)' >> "$OUT/steps.log" 2>&1

# -- tests on the device: kernels vs gguf-py, graph capture, pinned copies, streamed == resident --
want tests && step tests 330 $PY -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/junit.xml" \
    tests/decoder/test_triton.py tests/decoder/test_cuda.py tests/decoder/test_zero_copy.py > "$OUT/tests.log" 2>&1

# -- the slice of issue 9: a Qwen3-30B-A3B-shaped model, 12 layers --
SLICE=/tmp/moestream-slice.gguf
[ -f "$SLICE" ] || ! { want kernels || want bench-slice; } || step make-model 180 $PY -m moestream make-model "$SLICE" --arch qwen3moe --quant Q4_K --layers 12 \
    --experts 64 --top-k 8 --hidden 2048 --expert-ff 768 --heads 32 --kv-heads 4 --head-dim 128 --vocab 32768 \
    >> "$OUT/steps.log" 2>&1

# per-layer expert time, decode (1 row) and prefill (64 rows): fused kernels vs dequantize + matmul
cat > /tmp/moestream-kernels.py <<'EOF'
import sys, torch
from moestream.common.layout import ModelLayout
from moestream.decoder.experts.source import ResidentExperts

layout = ModelLayout(sys.argv[1])
hp = layout.hparams
def ms_per_layer(src, n, reps=20):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, hp.n_embd, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(n, hp.n_expert_used, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(hp.n_expert, device="cuda", generator=g)[:hp.n_expert_used] for _ in range(n)])
    for layer in range(2):
        src.mix(layer, x, w, ids)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(reps):
        src.mix(i % hp.n_layer, x, w, ids)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps
blob = layout.experts.blob_bytes(0)
from moestream.decoder.kernels.gpu import quant as tq
fused = ResidentExperts(layout, "cuda", torch.bfloat16, "raw", kernels=True)
print("tile sweep, 1 row (BN rows x BK cols per program, warps): ms per layer")
for bn, bk, warps in [(16, 256, 4), (8, 256, 2), (8, 256, 4), (32, 256, 4), (32, 256, 8), (64, 256, 8),
                      (16, 128, 4), (16, 64, 4), (4, 256, 2)]:
    tq.TILE_ROWS, tq.TILE_COLS, tq.NUM_WARPS = bn, bk, warps
    try:
        print(f"  {bn:3d} x {bk:3d}, {warps} warps: {ms_per_layer(fused, 1):8.3f}")
    except Exception as e:
        print(f"  {bn:3d} x {bk:3d}, {warps} warps: failed: {str(e).splitlines()[0][:200]}")
tq.TILE_ROWS, tq.TILE_COLS, tq.NUM_WARPS = 16, 256, 4
fused.close()
for kernels in (True, False):
    src = ResidentExperts(layout, "cuda", torch.bfloat16, "raw", kernels=kernels)
    for n in (1, 4, 64):
        t = ms_per_layer(src, n)
        moved = min(n * hp.n_expert_used, hp.n_expert) * blob
        print(f"{'triton' if kernels else 'torch '} rows {n:3d}: {t:8.3f} ms per layer, {moved / t / 1e6:8.1f} GB/s of expert bytes")
    src.close()
EOF
want kernels && step kernels 240 $PY /tmp/moestream-kernels.py "$SLICE" > "$OUT/kernels.txt" 2>&1

bench() {  # bench NAME MODEL: JSON and the human report from the same run
    local name=$1 model=$2
    step "bench-$name" 420 $PY -m moestream bench decode --model "$model" --device cuda -n 32 --repeat 2 --json \
        > "$OUT/bench_$name.json" 2> "$OUT/bench_$name.err"
    $PY -c 'import json, sys; from moestream.decoder.bench.decode import report; print(report(json.load(open(sys.argv[1]))))' \
        "$OUT/bench_$name.json" > "$OUT/bench_$name.txt" 2>&1
}
want bench-slice && bench slice "$SLICE"
want bench-tiny && bench tiny src/moestream/data/tiny-qwen3moe-q8_0.gguf
log "done"
