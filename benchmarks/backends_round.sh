#!/usr/bin/env bash
# The workloads once per attention backend, and vLLM 0.25.1 on the prefill-heavy one, in one sitting
# on the GPU machine, after `benchmarks/gpu_round.sh` installed the project (its wheels in /tmp/site).
#   bash benchmarks/backends_round.sh peer-ph ph w2 w1
# Stages:
#   peer-w1-fp8  vLLM on W1 with its online fp8 (--quantization fp8)
#   peer-w    vLLM on W2 and W1 in bf16 (peer-w2, peer-w1: one of them)
#   w1-fp8   W1 on TRITON_ATTN: bf16, fp8 weights, fp8 weights + fp8 KV cache
#   async    W2 and W1 with --no-async-scheduling and --async-scheduling (ASYNC_BACKEND, TRITON_ATTN)
#   ph-fp8   the prefill-heavy workload, bf16 and fp8 weights (PH_FP8_BACKEND, default FLASH_ATTN)
#   peer-ph  vLLM on the prefill-heavy workload (256 requests, 2,048 in / 16 out, W2's model),
#            through the peer harness (.vllm-peer/run.sh, carried as an ignored folder)
#   ph w2 w1 pagellm on the prefill-heavy workload, W2 and W1, once per backend of $BACKENDS, through
#            the harness's peer_bench.py: the same requests as vLLM's (sha256 in each JSON), timed by
#            `pagellm bench throughput`'s loop; TTFT (all requests arrive at once) in details.ttft_ms
# Environment: BACKENDS (default "TRITON_ATTN FLASHINFER FLASH_ATTN"), OUT.
# Output: $OUT/<stage>_<backend>.json and .log, and a table at the end.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BACKENDS=${BACKENDS:-"TRITON_ATTN FLASHINFER FLASH_ATTN"}
PREFILL_HEAVY="--input-len-range 2048 2048 --output-len-range 16 16"
export PYTHONPATH=${SITE:-/tmp/site} PROJ=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/build/flashinfer}

pagellm_run() {  # pagellm_run NAME WORKLOAD SECONDS BACKEND [flags...]
  local name=$1 workload=$2 secs=$3 backend=$4; shift 4
  local t0=$SECONDS
  # shellcheck disable=SC2068
  timeout -k 10 "$secs" bash benchmarks/workloads.sh "$workload" --attention-backend "$backend" $@ \
    --output-json "$OUT/${name}_$backend.json" >"$OUT/${name}_$backend.log" 2>&1
  echo "=== $name $backend rc=$? in $((SECONDS - t0)) s"
  grep -aE "FlashInfer: |FLASH_ATTN|Traceback|Error" "$OUT/${name}_$backend.log" | cut -c1-240 | head -8
}

peer() {  # peer NAME WORKLOAD SECONDS [PEER_EXTRA]: one vLLM stage of the peer harness
  # Its JSON is copied to $OUT/NAME_vllm.json at once and the harness's other files go into one
  # tarball: a call to the GPU machine brings back few files, and may be cut off by its limit.
  local name=$1 workload=$2 secs=$3 extra=${4:-}
  rm -rf "$OUT/peer"
  OUT=$OUT/peer STAGES="vllm:$workload" BUDGET_S=$secs PEER_EXTRA=$extra bash .vllm-peer/run.sh 2>&1 | tail -4
  cp "$OUT/peer/vllm_${workload}_equal.json" "$OUT/${name}_vllm.json" 2>/dev/null
  tar -czf "$OUT/peer_$name.tgz" -C "$OUT" peer && rm -rf "$OUT/peer"
}

for stage in "$@"; do
  case $stage in
    peer-ph) peer ph W2 300 "$PREFILL_HEAVY" ;;
    # vLLM's online fp8 (weights; activations per token) on W1, for issue 15's comparison.
    peer-w1-fp8) peer w1fp8 W1 300 "--quantization fp8" ;;
    # vLLM in bf16 on W2 and W1 (its settings as pagellm's: the harness's "equal").
    peer-w) peer w2 W2 240; peer w1 W1 300 ;;
    peer-w2) peer w2 W2 240 ;;
    peer-w1) peer w1 W1 300 ;;
    ph) for b in $BACKENDS; do pagellm_run ph W2 200 "$b" $PREFILL_HEAVY; done ;;
    # W1 on TRITON_ATTN in bf16, with fp8 weights, and with fp8 weights and an fp8 KV cache
    # (TRITON_ATTN reads an fp8 cache; FLASHINFER and FLASH_ATTN do not).
    w1-fp8)
      pagellm_run w1q_bf16 W1 240 TRITON_ATTN
      pagellm_run w1q_fp8 W1 240 TRITON_ATTN --quantization fp8
      pagellm_run w1q_fp8kv W1 240 TRITON_ATTN --quantization fp8 --kv-cache-dtype fp8 ;;
    # The prefill-heavy workload in bf16 and with fp8 weights (FLASH_ATTN, or $PH_FP8_BACKEND).
    ph-fp8)
      pagellm_run phq_bf16 W2 200 "${PH_FP8_BACKEND:-FLASH_ATTN}" $PREFILL_HEAVY
      pagellm_run phq_fp8 W2 200 "${PH_FP8_BACKEND:-FLASH_ATTN}" $PREFILL_HEAVY --quantization fp8 ;;
    # W2 and W1 with async scheduling off and on (issue 17): the same tokens (the table's output
    # hash), and the speed-up.
    async) for w in W2 W1; do
        pagellm_run "async_off_$w" "$w" 240 "${ASYNC_BACKEND:-TRITON_ATTN}" --no-async-scheduling
        pagellm_run "async_on_$w" "$w" 240 "${ASYNC_BACKEND:-TRITON_ATTN}" --async-scheduling
      done ;;
    w2) for b in $BACKENDS; do pagellm_run w2 W2 200 "$b"; done ;;
    w1) for b in $BACKENDS; do pagellm_run w1 W1 240 "$b"; done ;;
    *) echo "unknown stage $stage" ;;
  esac
done

python3 - "$OUT" <<'PY'
import glob, json, os, sys
print(f"{'run':28s} {'out tok/s':>10s} {'elapsed s':>9s} {'startup s':>9s} {'TTFT mean/p99 ms':>18s}  requests  outputs  weights GB / KV tokens")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*_*.json"))):
    try:
        r = json.load(open(path))
    except (OSError, ValueError):
        continue
    r = r.get("pagellm", r)
    r.setdefault("details", r)
    t = (r.get("details") or {}).get("ttft_ms") or {}
    ttft = f"{t['mean']}/{t['p99']}" if t else ""
    sha = (r.get("requests") or {}).get("requests_sha256", "")[:12]
    out_sha = r.get("output_token_ids_sha256", "")[:8]
    print(f"{os.path.basename(path)[:-5]:28s} {r.get('output_tokens_per_s', ''):>10} {r.get('elapsed_s', ''):>9} "
          f"{r.get('startup_s', ''):>9} {ttft:>18s}  {sha}  {out_sha}  {r.get('decode_weight_gb', '')} / {r.get('kv_cache_tokens', '')}")
PY
