"""Classification throughput: ``classify`` against the seed's straightforward design.

Workload: ``--n`` sentences of 8-40 random in-vocab tokens behind a 40-token shared
instruction, scored against 4 single-token labels, on a random-weight model of
Qwen3-0.6B's shape (built once under ``~/.cache/slotinfer/bench``).

(a) the seed's design, written here with the model's own decoder: prompts sorted by
    length, cut into fixed batches of 1, 8 and 32 rows padded to the longest, a
    causal + padding mask, full-vocab logits at every position, the instruction
    re-encoded in every row; label scores from the last real position's logits.
(b) ``slotinfer.classify``: batches by token budget, the instruction's K/V computed
    once and shared, the head applied to the label rows at the last token only.

Useful GFLOP/s counts the FLOPs a single unpadded, unshared forward of each prompt
(instruction + sentence) needs: 2 x the linear weights x tokens, the causal attention
products, and the LM head at the last token only.  Figures are medians over
``--repeats`` passes.

    python benchmarks/bench_classify.py                   # the full workload
    python benchmarks/bench_classify.py --n 96 --baseline-n 32 --repeats 1   # ~1-2 min
    python benchmarks/bench_classify.py --budgets 256,512,1024,2048          # sweep budgets
    python benchmarks/bench_classify.py --transformers    # + transformers bf16, design (a)

``--sharing`` measures instead what sharing the prefix buys and costs, on the same
workload, side by side in one process with alternated repeats (medians):

(a) ``classify`` with the shared prefix: own (sentence) tokens/s and sentences/s;
(b) plain prefill of the same sentences without the prefix (``classify`` of the
    sentences alone, same labels): tokens/s;
(c) ``classify`` recomputing the prefix in every row (``share_prefix=False``): sentences/s;

and prints a/b (own tokens/s; 1.0 = the prefix costs nothing) and a/c (sentences/s).

    nice python benchmarks/bench_classify.py --sharing --n 128 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def transformers_worker(path: str, data_file: str, batch: int, repeats: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    data = json.loads(Path(data_file).read_text())
    prompts, label_ids = data["prompts"], data["label_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    lab = torch.tensor(label_ids)

    def once(prompts=prompts):
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        scores = [None] * len(prompts)
        for s in range(0, len(order), batch):
            idx = order[s:s + batch]
            rows = [prompts[i] for i in idx]
            L = max(len(r) for r in rows)
            ids = torch.tensor([r + [0] * (L - len(r)) for r in rows])
            att = torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in rows])
            with torch.inference_mode():
                logits = model(input_ids=ids, attention_mask=att).logits  # [N, L, vocab]
            last = logits[torch.arange(len(rows)), att.sum(1) - 1].float().log_softmax(-1)[:, lab]
            for i, row in zip(idx, last.log_softmax(-1).tolist()):
                scores[i] = row
        return scores

    once(prompts[:batch])  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        scores = once()
        times.append(time.perf_counter() - t)
    print(json.dumps({"seconds": statistics.median(times), "torch_threads": torch.get_num_threads(),
                      "scores": scores}))


if __name__ == "__main__" and sys.argv[1:2] == ["--transformers-worker"]:
    # torch's process must not load slotinfer's BLAS / MLX: the worker runs before those imports
    transformers_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    sys.exit(0)

sys.path.insert(0, str(ROOT))
import slotinfer  # noqa: E402  (loads the BLAS before mlx.core)
import mlx.core as mx  # noqa: E402

from slotinfer.classify import classify, default_token_budget  # noqa: E402
from slotinfer.engine.encoder import plan_batches  # noqa: E402
from slotinfer.testing import make_tiny_model  # noqa: E402

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936)
PREFIX_LEN, LABELS = 40, 4


def model_dir(cache: str) -> Path:
    path = Path(cache).expanduser() / "qwen3-0.6b-shape"
    if not (path / "config.json").exists():
        print(f"building a random Qwen3-0.6B-shaped model in {path} ...", file=sys.stderr)
        make_tiny_model("qwen3", path, overrides=QWEN3_06B, dtype="bfloat16")
    return path


def workload(model, n: int, seed: int):
    """(instruction ids, sentence id lists, label strings, label ids)."""
    tok = model.tokenizer
    vocab = sorted(tok.backend.get_vocab(with_added_tokens=False).values())
    rng = np.random.default_rng(seed)
    prefix = rng.choice(vocab, PREFIX_LEN).tolist()
    sentences = [rng.choice(vocab, int(rng.integers(8, 41))).tolist() for _ in range(n)]
    labels = []
    for tid in vocab[len(vocab) // 2:]:
        text = tok.decode([tid])
        if text.strip() and text not in labels and tok.encode(text, add_special_tokens=False) == [tid]:
            labels.append(text)
        if len(labels) == LABELS:
            break
    return prefix, sentences, labels, [tok.encode(s, add_special_tokens=False)[0] for s in labels]


# -- FLOPs -------------------------------------------------------------------------------

def layer_params(cfg) -> int:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size


def useful_flops(cfg, tokens: int) -> float:
    """One unpadded, unshared forward of ``tokens`` tokens, logits at the last one."""
    attn = 2 * 2 * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2  # QK^T and PV, causal pairs
    return cfg.num_layers * (2 * layer_params(cfg) * tokens + attn) + 2 * cfg.vocab_size * cfg.hidden_size


def sgemm_rate(m=1024, k=1024, n=3072, reps=20) -> float:
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a, b)
    for _ in range(3):
        mx.eval(a @ b)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(times) / 1e9


# -- (a) the seed's design ---------------------------------------------------------------

class PaddedCausal:
    """The seed's mask: [N, 1, L, L], key j visible from query i when j <= i and j < len."""

    offset = 0

    def __init__(self, lens, L):
        j = mx.arange(L)
        self._mask = ((j[None, :] <= j[:, None])[None] & (j[None, None, :] < mx.array(lens)[:, None, None]))[:, None]

    def update(self, layer, k, v):
        return k, v

    def mask(self, layer, L, window):
        return self._mask


def seed_design(model, prompts, label_ids, batch: int) -> np.ndarray:
    """Label scores [N, labels] the straightforward way; returns them in input order."""
    net = model.net
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out = np.zeros((len(prompts), len(label_ids)), dtype=np.float32)
    lab = mx.array(label_ids)
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        rows = [prompts[i] for i in idx]
        L = max(len(r) for r in rows)
        lens = [len(r) for r in rows]
        h = net(mx.array([r + [0] * (L - len(r)) for r in rows]), PaddedCausal(lens, L))
        logits = net.head(h)  # [N, L, vocab]: every position, as the seed does
        last = logits[mx.arange(len(rows)), mx.array(lens) - 1].astype(mx.float32)
        lp = last - mx.logsumexp(last, axis=-1, keepdims=True)
        sc = lp[:, lab]
        sc = sc - mx.logsumexp(sc, axis=-1, keepdims=True)
        out[idx] = np.array(sc)
    return out


# -- transformers (optional) -------------------------------------------------------------

def run_transformers(path, prompts, label_ids, batches, repeats, tmp):
    data = Path(tmp) / "classify_prompts.json"
    data.write_text(json.dumps({"prompts": prompts, "label_ids": label_ids}))
    out = {}
    for b in batches:
        cmd = [sys.executable, __file__, "--transformers-worker", str(path), str(data), str(b), str(repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"transformers run failed (batch {b}): {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        out[b] = got["seconds"], np.array(got["scores"])
    return out


# -- --sharing ---------------------------------------------------------------------------

def sharing(model, prefix, sentences, labels, repeats: int, budget: int | None) -> dict:
    """(a), (b), (c) of the module docstring, alternated ``repeats`` times; medians."""
    kwargs = {"a": dict(prefix=prefix), "b": {}, "c": dict(prefix=prefix, share_prefix=False)}

    def run(k, sents):
        return classify(model, sents, labels=labels, token_budget=budget, **kwargs[k])

    runs = {k: (lambda k=k: run(k, sentences)) for k in kwargs}
    for k in runs:  # warm-up
        run(k, sentences[:8])
    times = {k: [] for k in runs}
    out = {}
    for r in range(repeats):  # alternated, the order turned each repeat, so load drifts hit every run alike
        for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            t = time.perf_counter()
            out[k] = runs[k]()
            times[k].append(time.perf_counter() - t)
    n, own = len(sentences), sum(map(len, sentences))
    med = {k: statistics.median(v) for k, v in times.items()}
    err = max(abs(x.scores[lab] - y.scores[lab]) for x, y in zip(out["a"], out["c"]) for lab in labels)
    return dict(n=n, own_tokens=own, prefix_tokens=len(prefix), seconds=med, runs=times,
                own_tokens_per_s={k: own / med[k] for k in med}, sentences_per_s={k: n / med[k] for k in med},
                max_score_diff_a_c=err)


def report_sharing(got: dict) -> None:
    tps, sps, med = got["own_tokens_per_s"], got["sentences_per_s"], got["seconds"]
    names = {"a": "(a) classify, shared prefix", "b": "(b) plain prefill, no prefix",
             "c": "(c) classify, prefix recomputed"}
    print("| run | median s | own tokens/s | sentences/s | seconds of each repeat |")
    print("|---|---:|---:|---:|---|")
    for k, name in names.items():
        print(f"| {name} | {med[k]:.2f} | {tps[k]:.1f} | {sps[k]:.2f} | "
              f"{', '.join(f'{t:.2f}' for t in got['runs'][k])} |")
    print(f"\na/b own tokens/s: {tps['a'] / tps['b']:.2f}x (target >= 0.9x); "
          f"a/c sentences/s: {sps['a'] / sps['c']:.2f}x; max |score a - score c| {got['max_score_diff_a_c']:.1e}")


# -- main --------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="sentences for classify (default 2000)")
    ap.add_argument("--baseline-n", type=int, default=None,
                    help="sentences for the seed's design (default min(n, 128); its rate is steady)")
    ap.add_argument("--batches", default="1,8,32", help="fixed batch sizes of the seed's design")
    ap.add_argument("--budgets", default=None, help="classify token budgets to measure (default: the library's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default="~/.cache/slotinfer/bench")
    ap.add_argument("--transformers", action="store_true", help="also time transformers bf16 on design (a)")
    ap.add_argument("--sharing", action="store_true",
                    help="shared prefix vs plain prefill vs recomputed prefix (see the module docstring)")
    ap.add_argument("--json", help="write the figures to this file too")
    args = ap.parse_args(argv)
    path = model_dir(args.cache)
    model = slotinfer.load(path)
    cfg = model.config
    prefix, sentences, labels, label_ids = workload(model, args.n, args.seed)
    if args.sharing:
        budget = int(args.budgets) if args.budgets else None
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"load {os.getloadavg()[0]:.1f}; BLAS {slotinfer.BLAS.name} ({slotinfer.BLAS.version}); "
              f"mlx {mx.__version__}; compute {model.dtype}; token budget {budget or default_token_budget()}")
        print(f"{args.n} sentences of {min(map(len, sentences))}-{max(map(len, sentences))} tokens "
              f"(mean {np.mean([len(s) for s in sentences]):.1f}) behind a {len(prefix)}-token prefix, "
              f"{len(labels)} labels; medians of {args.repeats} alternated repeats\n")
        got = sharing(model, prefix, sentences, labels, args.repeats, budget)
        report_sharing(got)
        print(f"load average now {os.getloadavg()[0]:.1f}")
        if args.json:
            Path(args.json).write_text(json.dumps(got, indent=2) + "\n")
        return
    base_n = min(args.n, args.baseline_n or 128)
    full = [prefix + s for s in sentences]
    useful = [useful_flops(cfg, len(p)) for p in full]
    load = os.getloadavg()[0]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load:.1f}; "
          f"BLAS {slotinfer.BLAS.name} ({slotinfer.BLAS.version}); mlx {mx.__version__}; compute {model.dtype}")
    print(f"model: {model}; {args.n} sentences of {min(map(len, sentences))}-{max(map(len, sentences))} tokens "
          f"(mean {np.mean([len(s) for s in sentences]):.1f}) behind a {len(prefix)}-token instruction, "
          f"labels {labels}")
    rate = max(sgemm_rate() for _ in range(3))
    print(f"raw sgemm through MLX (1024x1024 @ 1024x3072 f32, best of 3 medians): {rate:.0f} GFLOP/s")
    print(f"useful work: {np.mean(useful) / 1e9:.1f} GFLOP per sentence\n")

    rows = []

    def report(name, n, seconds, note=""):
        sps = n / seconds
        gflops = sum(useful[:n]) / seconds / 1e9
        rows.append(dict(name=name, n=n, seconds=seconds, sentences_per_s=sps, useful_gflops=gflops, note=note))
        print(f"| {name:<34} | {n:>5} | {seconds:8.2f} | {sps:8.2f} | {gflops:7.0f} | {gflops / rate:5.2f} | {note}",
              flush=True)

    print("| design                             |     n |  median s | sent/s | useful GFLOP/s | x sgemm | note")
    print("|---|---:|---:|---:|---:|---:|---|")
    seed_design(model, full[:4], label_ids, 4)  # warm-up
    classify(model, sentences[:8], prefix=prefix, labels=labels)
    batches = [int(x) for x in args.batches.split(",")]
    budgets = [int(x) for x in (args.budgets or str(default_token_budget())).split(",")]
    runs = [("a", b) for b in batches] + [("b", b) for b in budgets]
    times = {r: [] for r in runs}
    outputs = {}
    for _ in range(args.repeats):  # interleaved, so a change of machine load hits every design alike
        for kind, x in runs:
            if kind == "a":
                fn = lambda x=x: seed_design(model, full[:base_n], label_ids, x)  # noqa: E731
            else:
                fn = lambda x=x: classify(model, sentences, prefix=prefix, labels=labels, token_budget=x)  # noqa: E731
            t = time.perf_counter()
            outputs[(kind, x)] = fn()
            times[(kind, x)].append(time.perf_counter() - t)
    want = outputs[runs[0]]
    best_a = best_b = 0.0
    for kind, x in runs:
        secs = statistics.median(times[(kind, x)])
        if kind == "a":
            report(f"(a) seed design, batch {x}", base_n, secs)
            best_a = max(best_a, base_n / secs)
            continue
        res = outputs[(kind, x)]
        got = np.array([[r.scores[s] for s in labels] for r in res[:base_n]])
        err = float(np.abs(got - want).max())
        pad = sum(len(sentences[b[0]]) * len(b) for b in plan_batches([len(s) for s in sentences], x))
        note = f"max |score - (a)| {err:.1e}; padding {pad / sum(map(len, sentences)) - 1:.1%}"
        report(f"(b) classify, budget {x}", args.n, secs, note)
        best_b = max(best_b, args.n / secs)
    rate_end = sgemm_rate()
    print(f"\nraw sgemm again at the end: {rate_end:.0f} GFLOP/s (the x-sgemm column uses the start's {rate:.0f})")
    print(f"(b) / best (a): {best_b / best_a:.2f}x  (target >= 3x); "
          f"best useful GFLOP/s / sgemm: {max(r['useful_gflops'] for r in rows) / rate:.2f}x (target >= 1.5x); "
          f"load average now {os.getloadavg()[0]:.1f}")

    if args.transformers:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            got = run_transformers(path, full[:base_n], label_ids, [int(x) for x in args.batches.split(",")],
                                   args.repeats, tmp)
        if got:
            for b, (secs, scores) in got.items():
                report(f"transformers bf16, (a), batch {b}", base_n, secs,
                       f"max |score - (a)| {float(np.abs(scores - want).max()):.1e} (bf16)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(sgemm_gflops=rate, load=load, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
