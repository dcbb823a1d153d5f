#!/usr/bin/env bash
# A/B on the GPU machine, one sitting: W2 offline (bench throughput) and served (serve + bench
# serve) of a base tree against this one, rounds in the order given:
#   git archive BASE core plugins benchmarks | tar -x -C .prof_base   (here; carry .prof_base)
#   bash benchmarks/ab_w2.sh base new base new                        (there)
# The base tree is put first on PYTHONPATH; results under $OUT (w2_TAG.json, w2_serve_TAG.json).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/cuda_platform -e plugins/attention_backends/triton -e plugins/endpoints/openai -e plugins/endpoints/admin >"$OUT/install.log" 2>&1 || exit 1
B=$PWD/.prof_base
BASEPP=$B/core:$B/plugins/cuda_platform:$B/plugins/attention_backends/triton:$B/plugins/endpoints/openai:$B/plugins/endpoints/admin
serve() {  # serve TAG PYTHONPATH
  PYTHONPATH=$2 pagellm serve benchmarks/configs/qwen3-0.6b --load-format dummy --dtype bfloat16 \
    --skip-tokenizer-init --max-model-len 2049 --port 8300 >"$OUT/server_$1.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do curl -sf 127.0.0.1:8300/health >/dev/null && break; sleep 1; done
  PYTHONPATH=$2 python3 -c "import pagellm; print('$1 serves', pagellm.__file__)"
  PYTHONPATH=$2 timeout 200 pagellm bench serve --port 8300 --num-prompts 256 \
    --input-len-range 100 1024 --output-len-range 100 1024 --random-token-range 0 10000 \
    --temperature 0 --seed 0 --output-json "$OUT/w2_serve_$1.json" >"$OUT/w2_serve_$1.log" 2>&1
  grep -o '"output_tokens_per_s": [0-9.]*' "$OUT/w2_serve_$1.json" | head -1 | sed "s/^/$1 served /"
  kill -TERM $pid; wait $pid
}
offline() {  # offline TAG PYTHONPATH
  PYTHONPATH=$2 timeout 200 bash benchmarks/workloads.sh W2 --output-json "$OUT/w2_$1.json" >"$OUT/w2_$1.log" 2>&1
  grep -o '"output_tokens_per_s": [0-9.]*' "$OUT/w2_$1.json" | tail -1 | sed "s/^/$1 offline /"
}
for round in "$@"; do
  case $round in
    base) serve base "$BASEPP:/tmp/site"; offline base "$BASEPP:/tmp/site" ;;
    new) serve new /tmp/site; offline new /tmp/site ;;
  esac
done
