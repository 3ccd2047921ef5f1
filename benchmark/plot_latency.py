"""Plot decode step time vs batch size against the memory roofline from a latency.py JSON.

python benchmark/plot_latency.py docs/data/h200_latency_qwen3_0.6b.json docs/h200_decode_roofline.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    steps = data["decode_steps"]
    bs = [s["batch"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(bs, [s["step_ms"] for s in steps], "o-", label="minisgl decode step (CUDA graph)")
    ax.plot(bs, [s["roofline_ms"] for s in steps], "--", label="memory roofline (weights + KV) / copy BW")
    ax.plot(bs, [1.5 * s["roofline_ms"] for s in steps], ":", color="gray", label="1.5x roofline")
    ax.set_xlabel("batch size (context 600 tokens each)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{data['model']} {data['dtype'].replace('torch.', '')} on {data['device']}, {data['attention_backend']} attention")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
