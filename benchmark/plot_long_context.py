"""Plot long_context.py results: decode step and 32k prefill against their rooflines.

python benchmark/plot_long_context.py docs/h200_long_context.png docs/data/h200_long_context_triton.json [more.json ...]
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(dst: str, srcs: List[str]) -> None:
    runs: List[Dict[str, Any]] = [json.load(open(s)) for s in srcs]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [3, 1]})
    cases = [(d["context"], d["batch"]) for d in runs[0]["decode"] if d.get("fits")]
    width = 0.8 / (len(runs) + 1)
    xs = range(len(cases))
    for i, run in enumerate(runs):
        by = {(d["context"], d["batch"]): d for d in run["decode"] if d.get("fits")}
        ys = [by[c]["step_ms"] if c in by else 0.0 for c in cases]
        ax.bar([x + i * width for x in xs], ys, width, label=f"{run.get('label', run['attention_backend'])} step (graph replay)")
    roof = {(d["context"], d["batch"]): d["roofline_ms"] for d in runs[0]["decode"] if d.get("fits")}
    ax.bar(
        [x + len(runs) * width for x in xs],
        [roof[c] for c in cases],
        width,
        color="lightgray",
        hatch="//",
        label="roofline: (weights + KV) / copy BW",
    )
    ax.set_xticks([x + width * len(runs) / 2 for x in xs], [f"{c // 1024}k x {b}" for c, b in cases])
    ax.set_xlabel("context x batch")
    ax.set_ylabel("ms per decode step")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(f"decode, {runs[0]['model']} bf16, {runs[0]['device']}", fontsize=10)
    names = [r.get("label", r["attention_backend"]).replace(" (", "\n(") for r in runs] + ["roofline"]
    vals = [r["prefill"]["ms"] for r in runs] + [runs[0]["prefill"]["roofline_ms"]]
    bx.bar(names, vals, color=[f"C{i}" for i in range(len(runs))] + ["lightgray"])
    for i, v in enumerate(vals):
        bx.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    p = runs[0]["prefill"]
    bx.set_title(f"prefill {p['tokens'] // 1024}k prompt, {p['chunks']} chunks", fontsize=10)
    bx.set_ylabel("ms to first token")
    bx.tick_params(axis="x", labelsize=8)
    bx.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
