"""Embeddings: tokenmill's ``LLM.embed`` against sentence-transformers on the same model directory and CPU, in
one run, interleaved (``--rounds`` of each, the best of each reported), plus the largest difference between their
vectors. Optionally the server's /v1/embeddings too (``--server``: one request with every text).

    python -m benchmarks.embeddings --model all-minilm-l6-v2 --num-texts 256
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

WORDS = ("cache", "block", "token", "kernel", "vector", "query", "model", "server", "batch", "memory", "paris",
         "river", "market", "engine", "garden", "winter", "signal", "letter", "orange", "bridge")  # fmt: skip


def short_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` short texts of 3-20 words (a search box, a title, a sentence)."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))).capitalize() + "." for _ in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all-minilm-l6-v2")
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument(
        "--server", action="store_true", help="also time POST /v1/embeddings on a local server"
    )
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from tokenmill import LLM, system_info
    from tokenmill.model import registry as models

    path = (
        str(models.pull(args.model, progress=False, log=lambda s: None))
        if args.model in models.CATALOGUE
        else args.model
    )
    texts = short_texts(args.num_texts)
    llm = LLM(path)
    st = SentenceTransformer(path, device="cpu")
    num_tokens = sum(len(llm.get_tokenizer().encode(t)) for t in texts)
    print(system_info.one_line(system_info.collect()))
    print(f"{args.num_texts} texts, {num_tokens} tokens, torch threads {torch.get_num_threads()}")
    ours_s, theirs_s = [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        theirs = st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
        theirs_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        ours = np.asarray(llm.embed(texts))
        ours_s.append(time.perf_counter() - t)
    diff = float(np.abs(ours - theirs).max())
    cos = float(
        ((ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)).min()
    )
    best_ours, best_theirs = min(ours_s), min(theirs_s)
    print(f"sentence-transformers (batch {args.batch_size}): best {best_theirs * 1e3:.0f} ms, "
          f"median {sorted(theirs_s)[len(theirs_s) // 2] * 1e3:.0f} ms")  # fmt: skip
    print(f"tokenmill LLM.embed:  best {best_ours * 1e3:.0f} ms, median {sorted(ours_s)[len(ours_s) // 2] * 1e3:.0f} ms "
          f"({num_tokens / best_ours:.0f} tokens/s)")  # fmt: skip
    print(f"ratio (sentence-transformers / tokenmill, best of {args.rounds}): {best_theirs / best_ours:.2f}x; "
          f"max |diff| {diff:.2e}, min cosine {cos:.7f}")  # fmt: skip
    if args.server:
        _time_server(path, texts, args.rounds)


def _time_server(path: str, texts: list[str], rounds: int) -> None:
    import openai
    from tests.integration.serverproc import ServerProcess

    proc = ServerProcess("--model", path).start()
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused")
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            client.embeddings.create(model=Path(path).name, input=texts)
            times.append(time.perf_counter() - t)
        print(f"server /v1/embeddings (one request, base64): best {min(times) * 1e3:.0f} ms")
    finally:
        proc.stop()


if __name__ == "__main__":
    main()
