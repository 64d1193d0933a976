"""Buffers a forward writes in place, across pipeline stages.

torch.export keeps an in-place write to a buffer in the graph (rotary-embedding-torch's frequency cache:
``self.cached_freqs[:seq_len] = freqs.detach()``, an ``aten.copy_`` into a slice of a non-persistent buffer) and
reads the buffer's placeholder again afterwards. Each stage holds its own copy of the buffers it reads, so a
stage reading the buffer after another stage wrote it read its own, never written (nGPT at pp 2: layer 1's rotary
frequencies all zeros, every parameter off, no warning). Here the reads after the last write read an alias made
right after it, in the writing stage, and are sent to later stages as any value is; the buffer is no root a stage
may make again (``partition._computable_from_roots``). A stage that reads the buffer before another stage writes
it would read, on the next step, a value only the writer's rank holds: refused by name.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tracepp.split import rules
from tracepp.split.rules import where

aten = torch.ops.aten


def _base(node):
    """The placeholder a value views (through views of their first operand, and in-place ops, which return it), or
    None."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args and (
            rules.is_view(node, copies=True) or node.args[0] in rules.written(node)):
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op == "placeholder" else None


def written_buffers(graph: fx.Graph, state: dict) -> dict:
    """{buffer or constant placeholder: the ops writing it in place (into it or a view of it), in graph order}."""
    out: dict = {}
    for node in graph.nodes:
        for target in rules.written(node) if node.op == "call_function" else ():
            base = _base(target)
            if base is not None and base.name in state and state[base.name].kind != "parameter" and (
                    node not in out.get(base, ())):
                out.setdefault(base, []).append(node)
    return out


def read_after_writes(graph: fx.Graph, written: dict) -> dict:
    """Make the reads of each written buffer after its last write read an alias of it made right after that write;
    {alias: the write} (the alias must stay in the write's stage: ``pin``)."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    pins = {}
    for buffer, writes in written.items():
        last = writes[-1]
        later = [user for user in buffer.users if order[user] > order[last]]
        if not later:
            continue
        with graph.inserting_after(last):
            alias = graph.call_function(aten.alias.default, (buffer,))
        alias.meta.update({key: value for key, value in last.meta.items() if key != "val"})
        alias.meta["val"] = buffer.meta.get("val")
        for user in later:
            user.replace_input_with(buffer, alias)
        pins[alias] = last
    return pins


def pin(compute: list, boundaries: list, pins: dict) -> list:
    """``boundaries`` (where stages 1.. begin in ``compute``) moved so that each alias is in its write's stage."""
    position = {node: index for index, node in enumerate(compute)}
    out = list(boundaries)
    for alias in pins:
        at = position.get(alias)
        if at is not None and at in out:
            out[out.index(at)] = at + 1
    return sorted(set(out))


def check_reads(written: dict, stage_of: dict) -> None:
    """Refuse a buffer written on two stages, or read by a stage other than the one writing it (before the write:
    on the next step that read takes the value the writer's rank wrote)."""
    from tracepp.split.partition import SplitError

    fix = ("Make the value in forward() without keeping it in the buffer (a cache: compute it each call), or split so "
           "that its reads and writes are on one stage (pipe_split() markers, or --split-points)")
    for buffer, writes in written.items():
        writers = sorted({stage_of[w] for w in writes if w in stage_of})
        if len(writers) > 1:
            first = next(w for w in writes if stage_of.get(w) == writers[0])
            second = next(w for w in writes if stage_of.get(w) == writers[1])
            raise SplitError(f"the buffer '{buffer.name}' is written in place at {where(first)} (stage {writers[0]}) "
                             f"and at {where(second)} (stage {writers[1]}): each stage holds its own copy of a "
                             f"buffer, and neither would hold both writes. {fix}")
        for user in buffer.users:
            stage = stage_of.get(user)
            if writers and stage is not None and stage != writers[0]:
                raise SplitError(
                    f"the buffer '{buffer.name}' is written in place at {where(writes[-1])} (stage {writers[0]}) and "
                    f"read at {where(user)} (stage {stage}) before that write: each stage holds its own copy of a "
                    f"buffer, and on the next step that read would take the value the write left on another rank. "
                    f"{fix}")


def check_gradients(written: dict, needs_grad: dict) -> None:
    """Refuse a write of a value that carries a gradient into a buffer or constant (Meta's reference Llama writes
    each call's keys into ``self.cache_k``, a tensor that outlives the call): the next microbatch's backward would reach
    this one's graph through it ("Trying to backward through the graph a second time", as eager's second step)."""
    from tracepp.split.partition import SplitError

    for buffer, writes in written.items():
        for write in writes:
            targets = rules.written(write)
            source = next((a for a in write.all_input_nodes if a not in targets and needs_grad.get(a)), None)
            if source is not None:
                raise SplitError(
                    f"{write.name} at {where(write)} writes a value that carries a gradient ({source.name}) into "
                    f"'{buffer.name}', a buffer or tensor that outlives the call: the next microbatch's backward would "
                    f"run through this one's graph (eager fails likewise at its second step: \"Trying to backward "
                    f"through the graph a second time\"). Write source.detach() into it, or keep the value out of the "
                    f"module's state (a key/value cache is for inference: pass the keys on instead)")
