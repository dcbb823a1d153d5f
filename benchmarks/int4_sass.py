"""The fused int4 W4A16 kernel's main loop in SASS, per kind of program, without a GPU: Triton
compiles it for sm_90 (as plugins/quantization/int4/tests/sm90_compile.py does), its bundled
nvdisasm disassembles it, and the loop (the longest backward branch's span) is counted by
opcode. Instructions per thread per K tile (a 128-row tile of a program's BLOCK_N columns): a
static proxy for the work the GPU issues, next to the timings of ``int4_gemm.py``.

    python benchmarks/int4_sass.py [--variants "dot asm" "fma asm" ...] [--dump DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/quantization/int4/tests"))
from sm90_compile import VARIANTS as SM90_VARIANTS  # noqa: E402
from sm90_compile import compile_variant  # noqa: E402

# name: (kind constexprs, BLOCK_M, BLOCK_N, num_warps), the variants the CI compile check builds
VARIANTS = {name: rest for name, *rest in SM90_VARIANTS}
ADDRESS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*)$")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def compile_sass(kind: dict, block_m: int, block_n: int, warps: int) -> str:
    compiled = compile_variant(kind, block_m, block_n, warps)
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"int4_sass_{os.getpid()}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    try:
        return subprocess.run(
            [str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    finally:
        cubin.unlink()


def main_loop(sass: str) -> collections.Counter[str]:
    """Opcodes (without modifiers or predicates) of the longest backward branch's span."""
    instructions: list[tuple[int, str]] = []
    label_at: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        label = LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = ADDRESS.match(line)
        if found:
            address = int(found.group(1), 16)
            for name in pending:
                label_at[name] = address
            pending = []
            instructions.append((address, found.group(2)))
    span = (0, -1)
    for address, text in instructions:
        branch = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        if branch and label_at.get(branch.group(1), address) < address:
            start = label_at[branch.group(1)]
            if address - start > span[1] - span[0]:
                span = (start, address)
    opcodes: collections.Counter[str] = collections.Counter()
    for address, text in instructions:
        if span[0] <= address <= span[1]:
            opcode = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
            opcodes[opcode] += 1
    return opcodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--dump", type=Path, help="write each variant's whole SASS here")
    args = parser.parse_args()
    result = {}
    for name in args.variants:
        sass = compile_sass(*VARIANTS[name])
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / (name.replace(" ", "_") + ".sass")).write_text(sass)
        opcodes = main_loop(sass)
        result[name] = {"loop_instructions": sum(opcodes.values()), **dict(opcodes.most_common())}
        top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(10))
        print(f"{name}: {sum(opcodes.values())} a thread a K tile ({top})", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
