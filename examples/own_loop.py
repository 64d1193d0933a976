"""Train a tracepp output folder with your own loop: AdamW, a cosine LR schedule, clipping, evaluation.

    tracepp split examples/gpt.py -o out --ranks 2 --schedule 1f1b --microbatches 4 --optimizer adamw
    torchrun --nproc-per-node 2 examples/own_loop.py out --steps 20 --lr 3e-3 --save out/own.pt

Every rank runs this script. ``tracepp_runtime.Pipeline(folder)`` builds this rank's stages (weights from
``out/weights/``) and runs the job the split planned: its precision, its activation checkpointing per stage, and the
memory fit check before the first step (docs/guide.md); the loop is plain PyTorch around ``pipe.step``. The plan
counted the optimizer given to the split (``--optimizer adamw`` for this loop's AdamW). The batches come from the
model file's ``batch(step)`` here (``pipe.user`` is that module); any data loader works if every rank passes the same
batch. The last stage's rank prints the loss; ``--save`` writes one state_dict under the original FQNs.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the output folder of tracepp split")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    parser.add_argument("--save", default=None, help="write the trained state_dict here (from rank 0)")
    return parser.parse_args()


def main():
    args = parse_args()
    sys.path.insert(0, os.path.abspath(args.folder))  # the folder holds its own copy of the runtime
    import tracepp_runtime

    pipe = tracepp_runtime.Pipeline(args.folder)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    for step in range(args.steps):
        inputs, kwargs, target = pipe.user.batch(step)
        loss = pipe.step(inputs, kwargs, target)  # a tensor on the last stage's rank, None elsewhere
        pipe.sync_shared_grads()  # a tied embedding/head: both copies get the summed gradient
        norm = pipe.clip_grad_norm_(args.clip) if args.clip else pipe.grad_norm()  # same on every rank
        optimizer.step()
        schedule.step()
        pipe.zero_grad()
        if loss is not None:
            print(f"step {step + 1}/{args.steps} | loss {loss.item():.6f} | grad norm {norm.item():.4f} | "
                  f"lr {schedule.get_last_lr()[0]:.6g}", flush=True)
    inputs, kwargs, target = pipe.user.batch(args.steps)  # a batch the loop did not train on
    eval_loss = pipe.eval_step(inputs, kwargs, target)
    if eval_loss is not None:
        print(f"eval loss {eval_loss.item():.6f}", flush=True)
    if args.save:
        parts = [None] * pipe.world_size
        state = {name: tensor.cpu() for name, tensor in pipe.state_dict().items()}
        if pipe.world_size > 1:
            dist.all_gather_object(parts, state)
        else:
            parts = [state]
        if pipe.rank == 0:
            merged = {name: tensor for part in parts for name, tensor in part.items()}
            torch.save(merged, args.save)  # keys: each weight once (a tied weight under its first FQN)
            print(f"saved {args.save}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
