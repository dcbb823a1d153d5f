set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/cuda_platform -e plugins/attention_backends/triton >/dev/null 2>&1
ARGS="bench throughput --model benchmarks/configs/qwen3-0.6b --load-format dummy --dtype bfloat16 --skip-tokenizer-init --temperature 0 --seed 0 --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --random-token-range 0 10000"
for v in main base; do
  if [ $v = base ]; then export PYTHONPATH=$PWD/.prof_base/core:$PWD/.prof_base/plugins/cuda_platform:$PWD/.prof_base/plugins/attention_backends/triton:/tmp/site; fi
  python3 -c "import pagellm; print('$v', pagellm.__file__)"
  python3 -m cProfile -o $OUT/$v.prof -m pagellm.entrypoints.cli $ARGS > $OUT/$v.log 2>&1; grep -o '"output_tokens_per_s": [0-9.]*' $OUT/$v.log
  python3 -c "import pstats; s=pstats.Stats('$OUT/$v.prof'); s.sort_stats('tottime').print_stats(35)" > $OUT/${v}_prof.txt 2>&1
done
