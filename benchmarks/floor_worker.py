"""The floor of a pipeline on this machine: tracepp's plan run by the thinnest loop that can run it.

    torchrun --nproc-per-node R -m benchmarks.floor_worker OUT_DIR --steps K --metrics m.jsonl [--transport shm|gloo]

What the ``ideal`` of ``benchmarks/run.py`` leaves out is what running the plan on real processes costs whatever the
runtime: the messages, a rank's compute slowed by the other ranks computing beside it (shared caches and memory
bus), and the waits those two add to the schedule. This worker measures that cost without tracepp's executor. Each
rank runs its action list from OUT_DIR's ``manifest.json`` (the same schedule, the same order of sends and
receives) as a plain loop over

* the same stage functions the ideal prices (``tracepp.costs.measure_stages.StageCallables``: each stage's
  generated function with plain autograd, the last stage's ``loss_fn`` times the microbatch's scale);
* ``F``: the stage on its received activations (fresh leaves); ``B``: ``torch.autograd.backward`` from its outputs
  with the gradients its consumers sent (summed), then its inputs' gradients sent back; ``I`` / ``W`` (zero-bubble
  schedules): torch's own split backward, ``torch.distributed.pipelining._backward.stage_backward_input`` and
  ``stage_backward_weight``;
* each message posted where the plan posts it and waited on right before the compute that reads it, through
  tracepp's shared-memory rings (``--transport shm``, what tracepp's run.py uses between CPU ranks of one host) or
  gloo's ``isend``/``irecv``; sends are waited on at the end of the step;
* then plain SGD (``torch.optim.SGD``, lr ``--lr``) over the rank's parameters.

No checks, no metrics but the step's clock and one collective per step: the loss all-reduced after the optimizer
step, so that steps do not overlap across ranks (the ideal prices one step; without it a rank would start the next
step's forwards in the previous step's bubble) and every rank knows the loss, as a training loop that logs it or
stops on it needs (tracepp's step ends with one all-reduce too). Each rank is bound to its
own core as tracepp's run.py binds it (``cpu_binding.bind("auto")``), so the two differ in the loop only. The step
time is taken on the rank of the last stage, as tracepp's and torch's workers take theirs: one JSON line per step
(``step``, ``loss``, ``step_time_s``, ``cpu_time_s``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="a tracepp output folder (its manifest's plan and stage functions)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--transport", default="shm", choices=["shm", "gloo"])
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--paired-steps", type=int, default=0,
                        help="steps bracketed by in-run plain-autograd stage costs, as benchmarks/tracepp_worker.py")
    parser.add_argument("--paired-from", type=int, default=None, help="the first of those steps")
    parser.add_argument("--paired-costs", default=None, help="PREFIX of the per-rank JSON files of those costs")
    return parser.parse_args(argv)


class _Gloo:
    """gloo's point-to-point calls behind the shm transport's three methods."""

    @staticmethod
    def isend(tensor, peer, tag):
        return dist.isend(tensor, peer, tag=tag)

    @staticmethod
    def irecv(tensor, peer, tag):
        return dist.irecv(tensor, peer, tag=tag)

    def wait(self, work, timeout) -> bool:
        return work.wait(timeout)


class FloorRank:
    """One rank's share of the plan: its stages' callables, its action list, the messages of one step."""

    def __init__(self, folder: str, rank: int, transport: str, timeout: float):
        from tracepp.costs.measure_stages import StageCallables
        from tracepp.runtime.actions import Action

        plan_manifest = json.load(open(os.path.join(folder, "manifest.json")))
        plan = plan_manifest["plan"]
        self.rank = rank
        self.stage_rank = plan["stage_to_rank"]
        self.mbs = plan["num_microbatches"]
        self.actions = [Action.parse(text) for text in plan["actions"][str(rank)]]
        self.calls = StageCallables(folder, max_microbatches=self.mbs)  # every stage here; this rank runs its own
        self.specs = self.calls.specs
        self.last = len(self.specs) - 1
        self.own = sorted(s for s, r in enumerate(self.stage_rank) if r == rank)
        self.params = {s: self.calls.params[s] for s in self.own}
        # values crossing from producer stage p to consumer stage c, in manifest order: the message of an edge
        self.edges: dict = {}
        for name, value in plan_manifest["values"].items():
            for consumer in value["consumers"]:
                self.edges.setdefault((value["producer"], consumer), []).append((name, value))
        peers = {self.stage_rank[c] for (p, c) in self.edges if self.stage_rank[p] == rank} | \
                {self.stage_rank[p] for (p, c) in self.edges if self.stage_rank[c] == rank}
        peers.discard(rank)
        if transport == "shm":
            from tracepp.runtime import cpu_binding, shm_p2p

            self.wire, note = shm_p2p.connect(rank, peers, peers, shm_p2p.DEFAULT_RING_MB << 20, "shm",
                                              own_core=cpu_binding.has_own_core())
            if self.wire is None:
                raise SystemExit(f"the shared-memory transport is unavailable here: {note}")
        else:
            self.wire = _Gloo()
        self.timeout = timedelta(seconds=timeout)
        dynamic = sorted(name for name, value in plan_manifest["values"].items()
                         if not all(isinstance(size, int) for size in value["shape"]))
        if dynamic:
            raise SystemExit(f"the floor loop sizes its receive buffers from the manifest's static shapes; "
                             f"{', '.join(dynamic)} have symbolic dims: benchmark a model without dynamic_shapes")

    def _tag(self, direction: int, producer: int, consumer: int, mb: int, index: int) -> int:
        stages = len(self.specs)
        return (((direction * stages + producer) * stages + consumer) * self.mbs + mb) * 512 + index

    def _post_recv(self, kind: str, stage: int, peer: int, mb: int) -> None:
        """Post the receives of one comm action, into buffers of the manifest's static shapes."""
        producer, consumer = (peer, stage) if kind == "RECV_F" else (stage, peer)
        for index, (name, value) in enumerate(self.edges[(producer, consumer)]):
            if kind == "RECV_B" and not value["requires_grad"]:
                continue
            buffer = torch.empty(value["shape"], dtype=getattr(torch, value["dtype"]))
            tag = self._tag(0 if kind == "RECV_F" else 1, producer, consumer, mb, index)
            work = self.wire.irecv(buffer, self.stage_rank[peer], tag)
            self.pending[(kind, producer, consumer, mb)].append((work, name, buffer))

    def _take(self, kind: str, producer: int, consumer: int, mb: int) -> list:
        """Wait on that edge's messages of ``mb``; [(name, tensor)]."""
        got = []
        for work, name, buffer in self.pending.pop((kind, producer, consumer, mb), []):
            self._wait(work, f"{name} of microbatch {mb}")
            got.append((name, buffer))
        return got

    def _send(self, kind: str, stage: int, peer: int, mb: int) -> None:
        producer, consumer = (stage, peer) if kind == "SEND_F" else (peer, stage)
        for index, (name, value) in enumerate(self.edges[(producer, consumer)]):
            if kind == "SEND_F":
                pos = self.specs[stage]["outputs"].index(name)
                tensor = self.out[(stage, mb)][pos].detach()
            else:
                if not value["requires_grad"]:
                    continue
                tensor = self.in_grads[(stage, mb)][(producer, name)]
            tag = self._tag(0 if kind == "SEND_F" else 1, producer, consumer, mb, index)
            self.sends.append(self.wire.isend(tensor.contiguous(), self.stage_rank[peer], tag))

    def _forward(self, s: int, mb: int) -> None:
        calls = self.calls
        for item in self.specs[s]["received"]:
            producer = item["producer"]
            if self.stage_rank[producer] == self.rank:  # same rank: handed over in memory
                pos = self.specs[producer]["outputs"].index(item["name"])
                calls.values[mb][(producer, item["name"])] = self.out[(producer, mb)][pos].detach()
        for producer in {item["producer"] for item in self.specs[s]["received"]}:
            for name, tensor in self._take("RECV_F", producer, s, mb):
                calls.values[mb][(producer, name)] = tensor
        received, loss, out = calls._call(s, mb)
        self.received[(s, mb)] = [value for value, item in zip(received, self.specs[s]["received"])
                                  if item["requires_grad"]]  # the leaves whose gradients go back
        self.out[(s, mb)] = out
        if loss is not None:  # [the loss] (the microbatch's share of the mean)
            self.loss[(s, mb)] = loss
            self.step_loss = self.step_loss + loss[0].detach()

    def _backward_from(self, s: int, mb: int):
        """(tensors, gradients) a backward of stage ``s`` on ``mb`` starts from."""
        if s == self.last:
            return self.loss.pop((s, mb)), None
        sums: dict = {}
        for consumer in sorted({c for (p, c) in self.edges if p == s}):
            if self.stage_rank[consumer] == self.rank:
                got = [(name, grad) for (p, name), grad in self.in_grads.get((consumer, mb), {}).items() if p == s]
            else:
                got = self._take("RECV_B", s, consumer, mb)
            for name, grad in got:
                sums[name] = grad if name not in sums else sums[name] + grad
        out = self.out[(s, mb)]
        tensors, grads = [], []
        for pos, name in enumerate(self.specs[s]["outputs"]):
            if name in sums and isinstance(out[pos], torch.Tensor) and out[pos].requires_grad:
                tensors.append(out[pos])
                grads.append(sums[name])
        return tensors, grads

    def _keep_input_grads(self, s: int, mb: int, grads) -> None:
        items = [item for item in self.specs[s]["received"] if item["requires_grad"]]
        received = self.received.pop((s, mb))
        self.in_grads[(s, mb)] = {(item["producer"], item["name"]): (torch.zeros_like(value) if grad is None else grad)
                                  for item, value, grad in zip(items, received, grads)}

    def _backward(self, s: int, mb: int) -> None:
        tensors, grads = self._backward_from(s, mb)
        torch.autograd.backward(tensors, grads)
        self._keep_input_grads(s, mb, [value.grad for value in self.received[(s, mb)]])
        del self.out[(s, mb)]

    def _backward_input(self, s: int, mb: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_input

        tensors, grads = self._backward_from(s, mb)
        found, groups = stage_backward_input(tensors, grads, self.received[(s, mb)], iter(self.params[s]))
        self._keep_input_grads(s, mb, found)
        self.weight_groups[(s, mb)] = groups
        del self.out[(s, mb)]

    def _backward_weight(self, s: int, mb: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_weight

        stage_backward_weight(iter(self.params[s]), self.weight_groups.pop((s, mb)))

    def load_batch(self, step: int) -> None:
        """The microbatches of the model file's ``batch(step)`` (outside the step's clock, as the other workers)."""
        from tracepp.runtime.launch import user_batch

        calls = self.calls
        args, kwargs, target = user_batch(calls.pipe.user, step, calls.training)
        calls.batches = calls.pipe.splitter.split(step, tuple(args), kwargs, target, calls.device)
        calls.shapes = [calls.pipe.executor.shapes(**bound) for bound in calls.batches.symbols]

    def step(self) -> None:
        from collections import defaultdict

        self.pending, self.sends = defaultdict(list), []
        self.out, self.received, self.loss, self.in_grads, self.weight_groups = {}, {}, {}, {}, {}
        self.step_loss = torch.zeros(())
        for action in self.actions:
            s, kind, mb, peer = action
            if kind in ("RECV_F", "RECV_B"):
                self._post_recv(kind, s, peer, mb)
            elif kind in ("SEND_F", "SEND_B"):
                self._send(kind, s, peer, mb)
            elif kind == "F":
                self._forward(s, mb)
            elif kind == "B":
                self._backward(s, mb)
            elif kind == "I":
                self._backward_input(s, mb)
            elif kind == "W":
                self._backward_weight(s, mb)
            else:
                raise SystemExit(f"the floor loop does not run {kind!r} actions ({action})")
        for work in self.sends:
            self._wait(work, "a send's receive")

    def _wait(self, work, what: str) -> None:
        if self.wire.wait(work, self.timeout) is False:
            raise SystemExit(f"rank {self.rank}: waited {self.timeout.total_seconds():.0f} s for {what}")


def main(argv=None) -> None:
    args = parse_args(argv)
    from tracepp.runtime.cpu_binding import bind

    bind("auto")  # before gloo's threads start, as run.py does
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    floor = FloorRank(os.path.abspath(args.out_dir), rank, args.transport, args.timeout)
    if floor.calls.batches.targets[0] is None or not floor.calls.training:
        raise SystemExit("the floor loop trains: the folder needs a loss_fn")
    params = [p for s in floor.own for p in floor.params[s]]
    optimizer = torch.optim.SGD(params, lr=args.lr)
    for param in params:
        param.grad = None
    paired = None
    if args.paired_steps > 0:  # the stage costs of tracepp.costs.measure_in_run, taken by this loop's ranks
        from types import SimpleNamespace
        from tracepp.costs.measure_in_run import PairedCosts

        paired = PairedCosts(os.path.abspath(args.out_dir), args.paired_from, args.paired_steps,
                             os.path.abspath(args.paired_costs), rank)
        ranks_view = SimpleNamespace(device=torch.device("cpu"), precision="fp32", stage_indices=floor.own)
    dist.barrier()
    for step in range(args.steps):
        floor.load_batch(step)
        if paired is not None:
            paired.at_step(ranks_view, step)
        start, cpu_start = time.perf_counter(), time.process_time()
        floor.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(floor.step_loss)  # the step's one agreement: every rank knows the loss before the next step
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if paired is not None:
            paired.at_step_end(ranks_view, step)
        if floor.last in floor.own:
            with open(args.metrics, "a") as handle:
                handle.write(json.dumps({"step": step, "loss": float(floor.step_loss), "step_time_s": elapsed,
                                         "cpu_time_s": cpu}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
