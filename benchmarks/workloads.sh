#!/usr/bin/env bash
# The throughput workloads of docs/benchmarks.md, as `pagellm bench throughput` commands.
#   bash benchmarks/workloads.sh W1|W2 [extra flags, e.g. --backend hf --hf-mode continuous]
# Dummy bf16 weights, random prompt ids, ignore_eos, greedy. Model configs: benchmarks/configs/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
workload=${1:?usage: workloads.sh W1|W2 [flags]}
shift
common=(--load-format dummy --dtype bfloat16 --skip-tokenizer-init --temperature 0 --seed 0)
case $workload in
  W1) # Llama-3.1-8B architecture, 200 requests, 512 in / 512 out.
    exec pagellm bench throughput --model "$here/configs/llama-3.1-8b" "${common[@]}" \
      --num-prompts 200 --input-len 512 --output-len 512 "$@" ;;
  W2) # Qwen3-0.6B architecture, 256 requests, lengths uniform in [100, 1024], ids in [0, 10000).
    exec pagellm bench throughput --model "$here/configs/qwen3-0.6b" "${common[@]}" \
      --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 \
      --random-token-range 0 10000 "$@" ;;
  *) echo "unknown workload $workload (W1 or W2)" >&2; exit 2 ;;
esac
