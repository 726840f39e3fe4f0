"""Case (b), the offline mix, through tokenmill and transformers ``generate`` (static, padded, batch 64).

    python benchmarks/bench_throughput.py [--threads N] [--quick]

The suite's case (b) with only the ``hf`` peer: 64 requests, prompts of 32-256 tokens, outputs of
16-128 tokens, greedy, EOS ignored, identical token ids for both. Prints both times and the ratio;
``python benchmarks/suite.py --cases b`` adds the other peers and the hardware limit.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import suite  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    summary = suite.main(["--cases", "b", "--peers", "hf", "--int8-cases", "", "--no-overhead", *argv])
    times = {r["engine"]: r["time_s"] for r in summary["results"] if r["case"] == "b"}
    ours, theirs = times.get("tokenmill"), times.get("hf")
    print()
    print(f"case (b): tokenmill {_s(ours)}, transformers generate {_s(theirs)}", end="")
    print(f", ratio {theirs / ours:.2f}x" if ours and theirs else "")


def _s(t: float | None) -> str:
    return "n/a" if t is None else f"{t:.1f} s"


if __name__ == "__main__":
    main()
