"""The fused int4 W4A16 kernel's main loop in SASS, per kind of program, without a GPU: Triton
compiles it for sm_90 (as plugins/quantization/int4/tests/sm90_compile.py does), its bundled
nvdisasm disassembles it, and the loop (the longest backward branch's span) is counted by
opcode. Instructions per thread per K tile (a 128-row tile of a program's BLOCK_N columns): a
static proxy for the work the GPU issues, next to the timings of ``int4_gemm.py``.

    python benchmarks/int4_sass.py [--variants "dot asm m16 bn64" ...] [--dump DIR]
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
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/quantization/int4/tests"))
from pagellm_int4.kernels.unpack import CODE_OFFSET  # noqa: E402
from pagellm_int4.kernels.w4a16 import _w4a16_gemm_kernel  # noqa: E402
from sm90_compile import SIGNATURE, TARGET  # noqa: E402

DOT = dict(USE_DOT=True, USE_ASM=True, SWAP=False, CHAINS=1)
VARIANTS = {  # name: (kind constexprs, BLOCK_M, BLOCK_N, num_warps)
    "dot asm m16 bn64": (DOT, 16, 64, 4),
    "dot asm m16 bn128": (DOT, 16, 128, 4),
    "dot asm chains=2 m16 bn64": ({**DOT, "CHAINS": 2}, 16, 64, 4),
    "dot_t asm m16 bn128": ({**DOT, "SWAP": True}, 16, 128, 4),
    "dot shift m16 bn64": ({**DOT, "USE_ASM": False}, 16, 64, 4),
    "fma asm m1 bn64": ({**DOT, "USE_DOT": False}, 1, 64, 4),
    "fma shift m1 bn64": ({**DOT, "USE_DOT": False, "USE_ASM": False}, 1, 64, 4),
}
ADDRESS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*)$")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def compile_sass(kind: dict, block_m: int, block_n: int, warps: int) -> str:
    code = 1  # bfloat16 activations
    constexprs = {
        "TILES": 8,
        "SPLIT": True,
        "SERIAL": True,
        "GROUP_SIZE": 128,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": 128,
        "SCALES_PER_TILE": True,
        **kind,
        "CODE": code,
        "OFFSET": CODE_OFFSET[code],
        "EVEN_K": True,
        "EVEN_N": True,
    }
    signature = {**SIGNATURE, **dict.fromkeys(constexprs, "constexpr")}
    # What Triton's launcher marks at a Llama-8B shape (every pointer, and each integer that is
    # a multiple of 16 there: N, K and the strides).
    aligned = [n for n in SIGNATURE if n.endswith("_ptr") and n != "cnt_ptr"]
    aligned += ["N", "K", "stride_xm", "stride_qk", "stride_om", "stride_os"]
    attrs = {(list(signature).index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(
        ASTSource(_w4a16_gemm_kernel, signature, constexprs, attrs),
        target=TARGET,
        options={"num_warps": warps, "num_stages": 3},
    )
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
