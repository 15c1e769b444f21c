"""Greedy agreement and log-prob drift of the 8-bit activations (``SLOTINFER_INT8_ACTIVATIONS=1``) on a
real GGUF: the 12 conformance prompts of tests/cpu/test_qkernel.py (ten texts, two chats, 32 new tokens
each) through ``generate``, ``batch_generate`` and an ``Inferencer`` of 5 slots, with the option off
(float32 activations, the default) and on, against each other and against transformers' reading of
the same file (float32, gguf's dequantization).  The drift: each prompt with the default's greedy
continuation scored by both (teacher-forced), the largest and the mean difference of the tokens'
log-probs.

    python benchmarks/bench_int8_agreement.py MODEL.gguf [--no-transformers]

Needs the ``parity`` extra (torch, transformers) for the transformers column.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

import slotinfer
from slotinfer.cpu import qkernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cpu.test_qkernel import SMOL_CHATS, SMOL_NEW, SMOL_PROMPTS  # noqa: E402


def paths(model, ids):
    out = {"generate": [model.generate(p, max_tokens=SMOL_NEW).tokens for p in ids],
           "batch": [r.tokens for r in model.batch_generate(ids, max_tokens=SMOL_NEW)]}
    with slotinfer.Inferencer(model, slots=5, max_len=256) as inf:
        handles = [inf.submit(p, max_tokens=SMOL_NEW) for p in ids]
        out["inferencer"] = [h.result().tokens for h in handles]
    return out


def reference(path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in ids:
            x = torch.tensor([p])
            out = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=SMOL_NEW)
            want.append(out[0, len(p):].tolist())
    return want


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()
    module = qkernel.load()
    if module is None:
        raise SystemExit(f"the kernels are {qkernel.status()}")
    model = slotinfer.load(args.model)
    ids = [model.tokenizer.encode(p) for p in SMOL_PROMPTS + [model.apply_chat_template(c) for c in SMOL_CHATS]]
    want = None if args.no_transformers else reference(args.model, ids)
    got = {}
    for on in (False, True):
        module.set_int8_activations(on)
        got[on] = paths(model, ids)
    module.set_int8_activations(False)
    print(f"{args.model.name}: int8 loops {module.int8_kernels()}, {len(ids)} prompts, {SMOL_NEW} new tokens")
    for name in got[False]:
        line = f"  {name}: option on = off on {sum(a == b for a, b in zip(got[True][name], got[False][name]))}"
        if want is not None:
            for on in (False, True):
                same = sum(a == b for a, b in zip(got[on][name], want))
                line += f"; {'on' if on else 'off'} = transformers on {same}"
        print(line + f" of {len(ids)}", flush=True)
    # teacher-forced drift on the default's batch continuations
    seqs = [p + t for p, t in zip(ids, got[False]["batch"])]
    scored = {}
    for on in (False, True):
        module.set_int8_activations(on)
        scored[on] = [np.array(s.logprobs[1:], dtype=np.float64) for s in model.score(seqs)]
    module.set_int8_activations(False)
    diff = np.concatenate([np.abs(a - b) for a, b in zip(scored[True], scored[False])])
    print(f"  log-prob drift over {diff.size} tokens: max {diff.max():.4f}, mean {diff.mean():.5f}, "
          f"median {np.median(diff):.5f}", flush=True)


if __name__ == "__main__":
    main()
