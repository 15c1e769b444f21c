"""A free stream's inter-token gap alone, and beside rows under a costly constraint.

Each step fills the token masks of its constrained rows before it samples; a pathological
constraint (``a{100000}`` by default) makes each of its masks slow.  This prints the free
stream's median gap alone and beside ``--rows`` such rows, run side by side in one process,
and their ratio (slotinfer's target: at most 1.5).

    python benchmarks/bench_mask_isolation.py [--model PATH] [--rows 7] [--regex 'a{100000}']
"""

import argparse
import statistics
import time

import slotinfer
from slotinfer import default_model


def gaps(handle) -> list[float]:
    stamps = [time.perf_counter() for _ in handle]
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # from the second token: past the first step


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder or GGUF (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rows", type=int, default=7)
    p.add_argument("--regex", default="a{100000}")
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    model = slotinfer.load(a.model or default_model.path())
    prompt = model.chat_prompt(messages=[{"role": "user", "content": "Tell me a long story."}])
    with slotinfer.Inferencer(model, slots=a.rows + 1, max_len=1024) as inf:
        inf.generate(prompt, max_tokens=4, regex=a.regex)  # compiled once, cached: the runs below time steps only
        for _ in range(2):  # warm, then measure
            alone = gaps(inf.submit(prompt, max_tokens=a.tokens, ignore_eos=True))
            rows = [inf.submit(prompt, max_tokens=a.tokens + 32, regex=a.regex) for _ in range(a.rows)]
            beside = gaps(inf.submit(prompt, max_tokens=a.tokens, ignore_eos=True))
            for h in rows:
                h.cancel()
            for h in rows:
                try:
                    h.result()
                except Exception:
                    pass
    m_alone, m_beside = statistics.median(alone), statistics.median(beside)
    print(f"free stream median gap alone: {m_alone * 1000:.1f} ms; beside {a.rows} rows under {a.regex!r}: "
          f"{m_beside * 1000:.1f} ms; ratio {m_beside / m_alone:.2f}")


if __name__ == "__main__":
    main()
