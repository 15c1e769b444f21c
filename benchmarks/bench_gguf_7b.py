"""A 7B-shaped Q4_0 GGUF on CPU, its weights kept in their blocks: load time, memory, decode speed.

The file has Llama 2 7B's sizes (6.7e9 weights, 3.5 GiB) and random Q4_0 blocks, written by the
tests' GGUF writer (``write_random_gguf`` in tests/gguf_fixtures.py) tensor by tensor, into a
temporary folder deleted after.  A fresh process loads it and reports the load's wall time, its
peak resident memory, the resident memory once loaded, the model's weight bytes against the
file's size, and greedy decode tokens/s on the engine with one and two sequences (rows over the
median step of a run, then the median of ``--repeats`` interleaved runs), whose tokens it also gives alone
(``Model.generate``), for tests/loading/test_gguf_7b.py to compare.

    python benchmarks/bench_gguf_7b.py                   # write, measure, delete
    python benchmarks/bench_gguf_7b.py --tokens 32 --repeats 5 --dir /var/tmp
    python benchmarks/bench_gguf_7b.py --file model.gguf # an existing file, kept
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["The capital of France is", "Write a short poem about the sea:"]

CHILD = """
import json, resource, sys, time
import slotinfer
from mlx.utils import tree_flatten
from slotinfer.cli.bench import step_until_idle
from slotinfer.engine.engine import Engine

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

path, new, repeats, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
t = time.perf_counter()
m = slotinfer.load(path)
out = {"load_s": time.perf_counter() - t, "load_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
       "loaded_rss": rss(), "weights_bytes": sum(v.nbytes for _, v in tree_flatten(m.net.parameters()))}
out["alone"] = [m.generate(p, max_tokens=new, ignore_eos=True).tokens for p in prompts]

def engine(rows):  # (tokens, decode tokens/s of the median step: the prefill's and the first steps left out)
    e = Engine(m, slots=len(rows), max_len=max(len(m.encode_prompt(p)) for p in rows) + new, prefix_cache_bytes=0)
    items = [e.make_item(p, max_tokens=new, ignore_eos=True) for p in rows]
    for it in items:
        e.add(it)
    steps = [w for w, _ in step_until_idle(e)][2:-1]
    step = sorted(steps)[len(steps) // 2]
    return [it.handle.result(0).tokens for it in items], len(rows) / step

out["decode_tps_1"], out["decode_tps_2"] = [], []
for _ in range(repeats):  # interleaved, for the medians
    out["one"], tps = engine(prompts[:1])
    out["decode_tps_1"].append(tps)
    out["two"], tps = engine(prompts)
    out["decode_tps_2"].append(tps)
out["rss"] = rss()
print(json.dumps(out))
"""


def measure(path: Path, tokens: int, repeats: int = 1) -> dict:
    """The child's figures for the GGUF ``path`` (``tokens`` new tokens a prompt, the engine's runs
    ``repeats`` times), plus the file's size."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(tokens), str(repeats), json.dumps(PROMPTS)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "file_bytes": path.stat().st_size}


def write(path: Path) -> Path:
    import slotinfer  # noqa: F401  (first: the BLAS before mlx.core, which the fixtures import)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_fixtures import LLAMA2_7B, write_random_gguf

    return write_random_gguf(path, **LLAMA2_7B, qtype="Q4_0")


def report(r: dict) -> None:
    gib = 2**30
    size = r["file_bytes"]
    print(f"file               {size / gib:6.2f} GiB")
    print(f"load               {r['load_s']:6.1f} s")
    print(f"load peak RSS      {r['load_peak_rss'] / gib:6.2f} GiB ({r['load_peak_rss'] / size:.2f}x the file)")
    print(f"RSS once loaded    {r['loaded_rss'] / gib:6.2f} GiB ({r['loaded_rss'] / size:.2f}x)")
    print(f"RSS after decoding {r['rss'] / gib:6.2f} GiB ({r['rss'] / size:.2f}x)")
    print(f"weights            {r['weights_bytes'] / gib:6.2f} GiB ({r['weights_bytes'] / size:.3f}x)")
    for rows in (1, 2):
        tps = r[f"decode_tps_{rows}"]
        print(f"decode, {rows} sequence{'s' if rows > 1 else ' '}{statistics.median(tps):6.2f} tokens/s (median of "
              f"{', '.join(f'{x:.2f}' for x in tps)})")
    same = r["alone"][0] == r["one"][0] and r["alone"] == r["two"]
    print(f"tokens alone == batched: {same}  {r['alone']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16, help="new tokens a prompt")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the engine at 1 and 2 sequences")
    ap.add_argument("--dir", help="where to write the file (default: the system's temporary folder)")
    ap.add_argument("--file", help="an existing GGUF to load instead")
    args = ap.parse_args()
    if args.file:
        report(measure(Path(args.file), args.tokens, args.repeats))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t = time.perf_counter()
        path = write(Path(tmp) / "llama2-7b-Q4_0-random.gguf")
        print(f"written in {time.perf_counter() - t:.1f} s")
        report(measure(path, args.tokens, args.repeats))


if __name__ == "__main__":
    main()
