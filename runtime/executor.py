"""Run one rank's action list for a training (or forward-only) step.

The action list is compiled once, at start-up, into a list of closures: each closure already holds the
stage, the peer rank, the value names and the shape functions it needs, so a step is a plain loop with no
lookups by string and no metadata exchange. Runs of consecutive communication actions are posted together
(``batch_isend_irecv`` on NCCL) and waited on only right before the compute that needs them; sends are
waited on at the end of the step.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .shapes import compile_shape

_DIRECTION_TAG = {"F": 0, "B": 1}


def parse_action(text: str):
    """'0F1' -> (0, 'F', 1, None); '0SEND_F1>2' -> (0, 'SEND_F', 1, 2). Torch-only twin of codegen.actions."""
    import re

    match = re.match(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:[<>](\d+))?$", text)
    if not match:
        raise ValueError(f"bad action {text!r}")
    stage, kind, mb, peer = match.groups()
    return int(stage), kind, int(mb), None if peer is None else int(peer)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _shapes_from_manifest(manifest: dict):
    """The rank script's ``boundary_shapes`` rebuilt from the manifest (for callers without a rank script)."""
    fns = {name: compile_shape(v["shape"]) for name, v in manifest["values"].items()}
    sizes = {item["name"]: compile_shape([item["expr"]])
             for stage in manifest["stages"] for item in stage.get("sym_inputs", [])}

    def shapes(**symbols):
        result = {name: fn(symbols) for name, fn in fns.items()}
        result.update({name: fn(symbols)[0] for name, fn in sizes.items()})
        return result
    return shapes


class StageRunner:
    """One stage on this rank: its function, its state tensors, and per-microbatch activations."""

    def __init__(self, spec: dict, fn, state_tensors: list, root_leaf_indices: list, is_last: bool):
        self.index = spec["index"]
        self.fn = fn
        self.state = state_tensors
        self.params = [t for t in state_tensors if isinstance(t, torch.nn.Parameter) and t.requires_grad]
        self.root_leaf_indices = root_leaf_indices
        self.received = spec["received"]  # [{producer, name, shape, dtype, requires_grad}]
        self.received_index = {(r["producer"], r["name"]): i for i, r in enumerate(self.received)}
        self.outputs = spec["outputs"]
        self.output_requires_grad = spec["output_requires_grad"]
        self.sym_names = [item["name"] for item in spec.get("sym_inputs", [])]
        self.is_last = is_last
        self.reset(0)

    def reset(self, num_microbatches: int) -> None:
        self.inputs = [[None] * len(self.received) for _ in range(num_microbatches)]
        self.out = [None] * num_microbatches
        self.loss = [None] * num_microbatches
        self.out_grads = [[None] * len(self.outputs) for _ in range(num_microbatches)]
        self.in_grads = [None] * num_microbatches
        self.recv_works = [[] for _ in range(num_microbatches)]
        self.grad_works = [[] for _ in range(num_microbatches)]
        self.grad_buffers = [[] for _ in range(num_microbatches)]  # (output position, received gradient)
        self.pending_weight = {}  # mb -> (tensors, grads) kept from I for W


class RankExecutor:
    def __init__(self, manifest: dict, rank: int, stage_functions: dict, actions: list, state_by_fqn: dict,
                 device: torch.device, loss_fn, timeout_s: float, out_spec, training: bool, shapes=None):
        import torch.utils._pytree as pytree

        self.pytree = pytree
        self.rank = rank
        self.device = device
        self.loss_fn = loss_fn
        self.training = training
        self.timeout = timedelta(seconds=timeout_s)
        self.out_spec = out_spec
        self.stage_to_rank = manifest["plan"]["stage_to_rank"]
        self.num_stages = len(self.stage_to_rank)
        self.last_stage = self.num_stages - 1
        self.use_batch_p2p = device.type == "cuda"
        self.output_leaves = manifest["output_leaves"]
        self.stages = {}
        for spec in manifest["stages"]:
            if self.stage_to_rank[spec["index"]] != rank:
                continue
            tensors = [state_by_fqn[ref["fqn"]] for ref in spec["state"]]
            self.stages[spec["index"]] = StageRunner(spec, stage_functions[spec["index"]], tensors,
                                                     spec["root_leaf_indices"], spec["index"] == self.last_stage)
        # which outputs of a stage go to which consumer, in the order they travel
        self.edge_values = {}  # (producer, consumer) -> [(output position, name, meta)]
        for spec in manifest["stages"]:
            for position, name in enumerate(spec["outputs"]):
                value = manifest["values"].get(name)
                if value is None or value["producer"] != spec["index"]:
                    continue
                for consumer in value["consumers"]:
                    self.edge_values.setdefault((spec["index"], consumer), []).append((position, name, value))
        self.shapes = shapes if shapes is not None else _shapes_from_manifest(manifest)
        self.program = self._compile(actions)

    # -- compile ---------------------------------------------------------------------------------------
    def _compile(self, actions: list) -> list:
        program, batch = [], []
        for text in actions:
            stage, kind, mb, peer = parse_action(text)
            if kind.startswith(("SEND", "RECV")):
                batch.append(self._comm_op(stage, kind, mb, peer))
                continue
            if batch:
                program.append(self._comm_batch(batch))
                batch = []
            runner = self.stages[stage]
            if kind == "F":
                program.append(lambda r=runner, m=mb: self._forward(r, m))
            elif kind == "B":
                program.append(lambda r=runner, m=mb: self._backward(r, m, "full"))
            elif kind == "I":
                program.append(lambda r=runner, m=mb: self._backward(r, m, "input"))
            elif kind == "W":
                program.append(lambda r=runner, m=mb: self._backward(r, m, "weight"))
        if batch:
            program.append(self._comm_batch(batch))
        return program

    def _tag(self, direction: str, producer: int, consumer: int, index: int) -> int:
        return ((_DIRECTION_TAG[direction] * self.num_stages + producer) * self.num_stages + consumer) * 512 + index

    def _comm_op(self, stage: int, kind: str, mb: int, peer: int):
        """A function returning [(is_send, tensor, peer_rank, tag, on_done)] for one comm action."""
        if peer is None:
            raise ValueError(f"action {stage}{kind}{mb} has no peer stage; the plan must be lowered by tracepp")
        peer_rank = self.stage_to_rank[peer]
        if kind == "SEND_F":
            runner, items = self.stages[stage], self.edge_values[(stage, peer)]

            def ops():
                out = runner.out[mb]
                return [(True, out[pos].detach().contiguous(), peer_rank, self._tag("F", stage, peer, i), None)
                        for i, (pos, _name, _v) in enumerate(items)]
        elif kind == "RECV_F":
            runner, items = self.stages[stage], self.edge_values[(peer, stage)]
            slots = [runner.received_index[(peer, name)] for _pos, name, _v in items]

            def ops():
                result = []
                for i, ((_pos, name, value), slot) in enumerate(zip(items, slots)):
                    buffer = torch.empty(self.mb_shapes[mb][name], dtype=_dtype(value["dtype"]), device=self.device)
                    runner.inputs[mb][slot] = buffer
                    result.append((False, buffer, peer_rank, self._tag("F", peer, stage, i), runner.recv_works[mb]))
                return result
        elif kind == "SEND_B":
            runner = self.stages[stage]
            items = [(i, runner.received_index[(peer, name)]) for i, (_p, name, v) in
                     enumerate(self.edge_values[(peer, stage)]) if v["requires_grad"]]

            def ops():
                grads = runner.in_grads[mb]
                return [(True, grads[slot], peer_rank, self._tag("B", peer, stage, i), None) for i, slot in items]
        else:  # RECV_B
            runner = self.stages[stage]
            items = [(i, pos, name) for i, (pos, name, v) in enumerate(self.edge_values[(stage, peer)])
                     if v["requires_grad"]]

            def ops():
                result = []
                for i, pos, name in items:
                    value = runner.out[mb][pos]
                    buffer = torch.empty(value.shape, dtype=value.dtype, device=self.device)
                    runner.grad_buffers[mb].append((pos, buffer))
                    result.append((False, buffer, peer_rank, self._tag("B", stage, peer, i), runner.grad_works[mb]))
                return result
        return ops

    def _comm_batch(self, op_builders: list):
        def run():
            ops = [op for build in op_builders for op in build()]
            if not ops:
                return
            if self.use_batch_p2p:
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, tensor, peer, tag=tag)
                                                for send, tensor, peer, tag, _ in ops])
            else:
                works = [(dist.isend if send else dist.irecv)(tensor, peer, tag=tag)
                         for send, tensor, peer, tag, _ in ops]
            for work, (send, _tensor, _peer, _tag, waitlist) in zip(works, ops):
                if send:
                    self.send_works.append(work)
                elif waitlist is not None:
                    waitlist.append(work)
        return run

    # -- compute ---------------------------------------------------------------------------------------
    def _wait(self, works: list) -> None:
        for work in works:
            work.wait(self.timeout)
        works.clear()

    def _forward(self, runner: StageRunner, mb: int) -> None:
        self._wait(runner.recv_works[mb])
        leaves = self.mb_leaves[mb]
        inputs = runner.inputs[mb]
        for slot, spec in enumerate(runner.received):
            tensor = inputs[slot]
            if tensor is None:  # produced by a stage on this rank
                producer = self.stages[spec["producer"]]
                tensor = producer.out[mb][producer.outputs.index(spec["name"])].detach()
            if self.training and spec["requires_grad"]:
                tensor.requires_grad_(True)
            inputs[slot] = tensor
        args = runner.state + [leaves[i] for i in runner.root_leaf_indices] + inputs
        if runner.sym_names:
            args += [self.mb_shapes[mb][name] for name in runner.sym_names]
        with torch.set_grad_enabled(self.training):
            out = runner.fn(*args)
        runner.out[mb] = out
        if runner.is_last:
            leaves_out = [out[i] if kind == "value" else const for i, (kind, const) in enumerate(self.output_leaves)]
            output = self.pytree.tree_unflatten(leaves_out, self.out_spec)
            if self.loss_fn is not None and self.training:
                loss = self.loss_fn(output, self.targets[mb]) * self.scales[mb]
                runner.loss[mb] = loss
                self.step_loss = self.step_loss + loss.detach()
            else:
                self.outputs[mb] = output

    def _backward(self, runner: StageRunner, mb: int, part: str) -> None:
        if part == "weight":  # the second half of a split backward: weight gradients only
            tensors, grads = runner.pending_weight.pop(mb)
            if tensors and runner.params:
                torch.autograd.backward(tensors, grads, inputs=runner.params)
            self._release(runner, mb)
            return
        if runner.is_last:
            tensors, grads = [runner.loss[mb]], [None]
        else:
            tensors, grads = self._output_grads(runner, mb)
        wanted = [t for t, s in zip(runner.inputs[mb], runner.received) if s["requires_grad"]]
        if part == "full":
            if tensors:
                torch.autograd.backward(tensors, grads)
            runner.in_grads[mb] = self._input_grads(runner, mb, [t.grad for t in wanted])
            self._release(runner, mb)
        else:  # "input": gradients for received activations now, weights later (zero-bubble schedules)
            found = (torch.autograd.grad(tensors, wanted, grads, retain_graph=True, allow_unused=True)
                     if tensors and wanted else [None] * len(wanted))
            runner.in_grads[mb] = self._input_grads(runner, mb, list(found))
            runner.pending_weight[mb] = (tensors, grads)

    def _output_grads(self, runner: StageRunner, mb: int):
        """Outputs that carry a gradient, with the sum of the gradients every consumer sent back."""
        self._wait(runner.grad_works[mb])
        sums = runner.out_grads[mb]
        for pos, buffer in runner.grad_buffers[mb]:
            sums[pos] = buffer if sums[pos] is None else sums[pos] + buffer
        runner.grad_works[mb], runner.grad_buffers[mb] = [], []
        tensors, grads = [], []
        for pos, grad in enumerate(sums):
            if grad is not None and runner.out[mb][pos].requires_grad:
                tensors.append(runner.out[mb][pos])
                grads.append(grad)
        return tensors, grads

    def _input_grads(self, runner: StageRunner, mb: int, found: list) -> list:
        """Gradients for this stage's received inputs, indexed by received slot; local producers get theirs now."""
        grads = [None] * len(runner.received)
        wanted_slots = [slot for slot, s in enumerate(runner.received) if s["requires_grad"]]
        for slot, grad in zip(wanted_slots, found):
            tensor = runner.inputs[mb][slot]
            if grad is None:
                grad = torch.zeros_like(tensor)
            grads[slot] = grad
            producer = self.stages.get(runner.received[slot]["producer"])
            if producer is not None:  # same rank: hand the gradient over in memory
                pos = producer.outputs.index(runner.received[slot]["name"])
                sums = producer.out_grads[mb]
                sums[pos] = grad if sums[pos] is None else sums[pos] + grad
        return grads

    def _release(self, runner: StageRunner, mb: int) -> None:
        runner.out[mb] = None
        runner.loss[mb] = None
        runner.out_grads[mb] = [None] * len(runner.outputs)

    # -- a step ----------------------------------------------------------------------------------------
    def run_step(self, mb_leaves: list, targets: list, scales: list, symbols: list):
        """Run every action once; returns the full-batch loss (a tensor) on the last stage's rank, else None."""
        num_microbatches = len(mb_leaves)
        self.mb_leaves, self.targets, self.scales, self.symbols = mb_leaves, targets, scales, symbols
        self.mb_shapes = [self.shapes(**bound) for bound in symbols]
        self.send_works = []
        self.step_loss = torch.zeros((), device=self.device)
        self.outputs = [None] * num_microbatches
        for runner in self.stages.values():
            runner.reset(num_microbatches)
        for instruction in self.program:
            instruction()
        for work in self.send_works:
            work.wait(self.timeout)
        self.send_works = []
        if self.last_stage in self.stages:
            return self.step_loss if self.training and self.loss_fn is not None else self.outputs
        return None
