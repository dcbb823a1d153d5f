"""One line per `pagellm bench throughput` JSON given: output tok/s, elapsed, steady decode step,
output-token hash, start-up, KV cache tokens, decode weights (what docs/benchmarks.md tabulates).

    python benchmarks/w1_summary.py OUT/w1_*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    for path in sys.argv[1:]:
        try:
            r = json.loads(Path(path).read_text())["pagellm"]
        except (OSError, ValueError, KeyError) as e:
            print(f"{Path(path).stem}: unreadable ({type(e).__name__})")
            continue
        step = (r.get("decode_roofline") or {}).get("mean_step_ms")
        print(
            f"{Path(path).stem}: {r['output_tokens_per_s']:.0f} tok/s, {r['elapsed_s']} s, "
            f"step {step} ms, sha {r['output_token_ids_sha256'][:12]}, start {r['startup_s']} s, "
            f"kv {r.get('kv_cache_tokens')} tokens, weights {r.get('decode_weight_gb')} GB"
        )


if __name__ == "__main__":
    main()
