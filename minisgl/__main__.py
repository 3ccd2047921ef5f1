"""`python -m minisgl`: serve a model over an OpenAI-compatible HTTP API (`--shell`: chat in the terminal).

With no arguments it serves the embedded SmolLM2-135M-Instruct on http://127.0.0.1:1919.
See `python -m minisgl --help`.
"""

from __future__ import annotations

import sys
from typing import List


def main(argv: List[str] | None = None) -> int:
    from minisgl.server.launch import main as launch_main

    return launch_main(argv)


if __name__ == "__main__":
    sys.exit(main())
