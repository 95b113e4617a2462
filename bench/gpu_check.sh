#!/usr/bin/env bash
# GPU check (issue 17, item 6), under 8 minutes on one GPU: a ~1B llmstack model at sequence 4096,
# bf16 ZeRO-2 with DeepSpeed's FusedAdam and flash SDPA (tokens/s and MFU against the dense peak
# table of llmstack.monitor.peak_flops), activation checkpointing off and on, the fp16 loss-scaling
# path, and the generation throughput of `llmstack generate` on the same model.
#
#   bench/gpu_check.sh [OUT_DIR]        (PYTHON=... to pick the interpreter; default: python)
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: no CUDA device: torch.cuda.is_available() is False (torch $("$PY" -c 'import torch; print(torch.__version__)'))." >&2
    echo "Run it on a machine with an NVIDIA GPU and a CUDA build of torch." >&2
    exit 2
fi
"$PY" -c 'import torch; print("GPU:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'

OUT="${1:-$(mktemp -d -t llmstack-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
echo "== training (bf16 ZeRO-2 / activation checkpointing / fp16), outputs in $OUT"
timeout 420 "$PY" bench/gpu_check.py "$OUT"

echo "== generation: llmstack generate, 8 prompts"
PROMPTS=()
for i in 1 2 3 4 5 6 7 8; do PROMPTS+=(--prompt "def function_$i(x):"); done
generate_seconds() {
    local start end
    start=$(date +%s.%N)
    "$PY" -m llmstack.cli.main generate --model "$OUT/model" "${PROMPTS[@]}" --temperature 0 \
        --max-new-tokens "$1" --device cuda > /dev/null
    end=$(date +%s.%N)
    "$PY" -c "print($end - $start)"
}
short=$(generate_seconds 1)   # loading and the prompt, to subtract
long=$(generate_seconds 257)
"$PY" -c "
tokens = 8 * 256
print(f'generate: {tokens} new tokens in {$long - $short:.2f} s (load + prefill {$short:.2f} s subtracted): '
      f'{tokens / ($long - $short):.0f} tokens/s')"
