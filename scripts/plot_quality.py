"""Perplexity against weight size, one point per weight format (KV formats left out), from `lowvram bench quality --json` records
(several records are merged by format name, the first one's row kept).

    python scripts/plot_quality.py run1.json [run2.json ...] --out docs/quality_real.png
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="SmolLM2-135M-Instruct: perplexity on real text against weight size")
    args = parser.parse_args()
    rows = {}
    for path in args.records:
        for row in json.load(open(path))["rows"]:
            rows.setdefault(row["variant"], row)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, row in rows.items():
        if name.startswith("kv-"):  # KV page formats: the weights are FP16's
            continue
        is_peer = name.startswith("llama.cpp")
        ax.scatter(
            row["weight_mib"], row["perplexity"], marker="s" if is_peer else "o", color="C1" if is_peer else "C0"
        )
        ax.annotate(name, (row["weight_mib"], row["perplexity"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("weights (MiB, FP16 embedding included)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(args.title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({len(rows)} formats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
