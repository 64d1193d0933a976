"""What activation checkpointing adds to a step, as a share of the forward it recomputes: the figures the tuner
prices ``full`` and ``selective`` with (``tracepp.costs.search.RECOMPUTE_SHARE``).

One process, one thread, a Hugging Face Llama of two layers at a few sizes (hidden H, sequence S, batch 2): the
forward alone (no grad), then forward and backward with no checkpointing, with torchtitan's op-level selective
policy (``runtime/recompute.selective_context``: matmul, attention and collective outputs kept) and with full
checkpointing; the median of 5 rounds of CPU time (``time.process_time``: what the work costs, whatever else
the machine runs). The extra time of a mode over ``none``, divided by the forward's, is the share of a forward
that the mode runs again.

    python -m benchmarks.studies.recompute_cost [--sizes 512x256,1024x512] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import os
import time


def measure(hidden: int, seq: int, rounds: int = 5) -> dict:
    import torch
    import torch.nn.functional as F
    import transformers as t
    from torch.utils.checkpoint import checkpoint

    from tracepp.runtime.recompute import selective_context

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = t.LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                           num_hidden_layers=2, num_attention_heads=hidden // 64,
                           num_key_value_heads=max(1, hidden // 128), max_position_embeddings=seq)
    model = t.LlamaForCausalLM(config)
    ids, target = torch.randint(0, 1024, (2, seq)), torch.randint(0, 1024, (2, seq))

    def forward():
        return F.cross_entropy(model(ids, use_cache=False).logits.flatten(0, 1), target.flatten())

    def step(mode: str) -> None:
        if mode == "forward":
            with torch.no_grad():
                forward()
            return
        if mode == "none":
            loss = forward()
        elif mode == "full":
            loss = checkpoint(forward, use_reentrant=False)
        else:
            loss = checkpoint(forward, use_reentrant=False, context_fn=selective_context)
        loss.backward()
        model.zero_grad(set_to_none=True)

    times: dict = {}
    for _round in range(rounds):
        for mode in ("forward", "none", "selective", "full"):
            start = time.process_time()
            step(mode)
            times.setdefault(mode, []).append(time.process_time() - start)
    median = {mode: sorted(values)[len(values) // 2] for mode, values in times.items()}
    forward_s = median["forward"]
    return {"hidden": hidden, "seq": seq, "batch": 2, "layers": 2, "cpu_s": median,
            "selective_share": (median["selective"] - median["none"]) / forward_s,
            "full_share": (median["full"] - median["none"]) / forward_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512x256,1024x512", help="HIDDENxSEQ, comma-separated")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args()
    import torch

    rows = [measure(*map(int, size.split("x"))) for size in args.sizes.split(",")]
    for row in rows:
        print(f"hidden {row['hidden']:5d} seq {row['seq']:5d}: selective re-runs {row['selective_share']:.2f} of a "
              f"forward, full {row['full_share']:.2f}")
    record = {"study": "recompute_cost", "torch": torch.__version__, "method": __doc__.split("\n\n")[1],
              "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, time.strftime("%Y%m%d-%H%M%S") + "_recompute_cost.json")
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
