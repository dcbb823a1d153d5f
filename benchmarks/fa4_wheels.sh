#!/usr/bin/env bash
# FA4's wheels (flash-attn-4 and its CuTe DSL, Python 3.12, CUDA 13) for the GPU machine, which
# has no network. nvidia-cutlass-dsl-libs-cu13 alone is 92 MB, and a call to the machine carries
# 64 MiB with the working tree, so the wheels travel in three parts over calls back to back (the
# machine keeps /tmp while it stays warm): two pieces of that wheel, then the third with the
# other FA4 wheels, in the call that installs (beside .whl, 23 MB):
#   here:         bash benchmarks/fa4_wheels.sh fetch    # -> .fa4whl/part1, part2 (40 MiB each), part3
#   GPU, call 1:  bash benchmarks/fa4_wheels.sh stash .fa4whl/part1      # carry [".fa4whl/part1"]
#   GPU, call 2:  bash benchmarks/fa4_wheels.sh stash .fa4whl/part2      # carry [".fa4whl/part2"]
#   GPU, call 3:  bash benchmarks/fa4_wheels.sh unpack && bash benchmarks/gpu_round.sh fa-tests ...
#                                                  # carry [".whl", ".fa4whl/part3", ...]
# `unpack` joins the pieces in $STASH with part3's, checks the sha256 and puts every FA4 wheel in
# .whl/ (replacing other versions of the same packages), which gpu_round.sh installs with the
# others (pip --target /tmp/site). A later call that carries .whl again runs `unpack` first
# (the stash is still there on a warm machine) so that the set of wheels, and so the install,
# stays the same. The .pth file of nvidia-cutlass-dsl is not run there; the backend puts
# /tmp/site/nvidia_cutlass_dsl/dsl_packages on sys.path itself
# (pagellm_flash_attn/kernels/fa4_setup.py).
set -euo pipefail
PY=${PY:-python3}
STASH=${STASH:-/tmp/fa4whl}
PINS=(
  flash-attn-4==4.0.0b36
  nvidia-cutlass-dsl==4.8.1          # its .pth file only; it requires -libs-cu12, the cu13 build replaces it
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
  quack-kernels==0.6.5
  torch-c-dlpack-ext==0.1.5          # a no-op on torch >= 2.10, which has the DLPack exchange API
  apache-tvm-ffi==0.1.15.post2       # FA4 needs >= 0.1.11; flashinfer-python 0.6.13 takes >= 0.1.6, < 0.2
)

case ${1:?usage: fa4_wheels.sh fetch | stash DIR | unpack} in
  fetch)
    [ -e .git ] || { echo "run from a repository root" >&2; exit 1; }
    exclude_file=$(git rev-parse --git-path info/exclude)
    grep -qxE '/?\.fa4whl/?' "$exclude_file" 2>/dev/null || echo '/.fa4whl/' >>"$exclude_file"
    rm -rf .fa4whl && mkdir -p .fa4whl/all .fa4whl/part1 .fa4whl/part2 .fa4whl/part3
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform any \
      -d .fa4whl/all "${PINS[@]}"
    cu13=$(ls .fa4whl/all/nvidia_cutlass_dsl_libs_cu13-*.whl)
    name=$(basename "$cu13")
    (cd .fa4whl/all && sha256sum "$name") >.fa4whl/part3/cu13.sha256
    split -b 40m "$cu13" ".fa4whl/all/$name.part-"
    mv ".fa4whl/all/$name.part-aa" .fa4whl/part1/
    mv ".fa4whl/all/$name.part-ab" .fa4whl/part2/
    mv ".fa4whl/all/$name".part-a[c-z] .fa4whl/part3/
    rm -f "$cu13"
    mv .fa4whl/all/*.whl .fa4whl/part3/
    rm -rf .fa4whl/all
    du -sh .fa4whl/part1 .fa4whl/part2 .fa4whl/part3 ;;
  stash)
    dir=${2:?fa4_wheels.sh stash DIR}
    mkdir -p "$STASH" && cp "$dir"/* "$STASH"/ && ls -l "$STASH" ;;
  unpack)
    sums=.fa4whl/part3/cu13.sha256
    name=$(awk '{print $2}' "$sums")
    cp .fa4whl/part3/* "$STASH"/
    cat "$STASH/$name".part-* >"$STASH/$name"
    (cd "$STASH" && sha256sum -c cu13.sha256)
    mkdir -p .whl
    for wheel in "$STASH"/*.whl; do  # one version per package: pip --target takes no two
      dist=$(basename "$wheel" | cut -d- -f1)
      for other in .whl/"$dist"-*.whl; do
        if [ -e "$other" ] && [ "$(basename "$other")" != "$(basename "$wheel")" ]; then
          echo "replacing $(basename "$other") by $(basename "$wheel")"; rm -f "$other"
        fi
      done
      cp "$wheel" .whl/
    done
    ls .whl | grep -E 'flash_attn|cutlass|quack|dlpack|tvm_ffi' ;;
  *) echo "unknown command $1 (fetch, stash or unpack)" >&2; exit 2 ;;
esac
