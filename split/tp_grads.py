"""Gradients of replicated parameters that sharded ops read: summed over tp once per step, not once per microbatch.

A whole value read beside shards (a per-head q/k norm's weight over heads split among the ranks, a norm's weight
under sequence parallelism, a deferred row-wise linear's bias) goes through ``tp_copy``: each rank's gradient is
its part of the whole one, and ``tp_copy``'s backward all-reduces it at every microbatch. Where that value is
made of parameters alone and every gradient those parameters take reaches them through such copies, the sum is
linear and can wait: each rank accumulates its part over the step's microbatches and the parts are summed once,
when the step ends, in one all-reduce of every such gradient together (``runtime.pipeline``; Megatron-Core's
``finalize_model_grads`` does the same for its sequence-parallel norms and q/k layernorms). The copies are
dropped from the stage graph, the parameters marked ``"grad": "partial"`` in the plan.

:func:`mark` decides it over all the stages' walks at once. The values made of parameters alone that carry a
gradient are joined where one reads another; such a group is summed at the step's end only where every edge by
which a gradient leaves it is a read through ``tp_copy``: a read by a sharded op, the deferred or
sequence-parallel row-wise linear's bias. One replicated read (an op every rank computes whole, a stage output)
keeps the per-microbatch copies, and so does a parameter any other stage reads otherwise (a parameter's gradient
is summed at one time: partial everywhere or nowhere)."""
from __future__ import annotations

import torch.fx as fx


def _copied_reads(walk) -> set:
    """(consumer, value) pairs the rewrite reads through ``tp_copy``: the walk's copies and the biases of its
    deferred (``tp_partial``) and reduce-scattered row-wise linears, where they carry a gradient."""
    pairs = set(walk.copies)
    for node, role in walk.roles.items():
        if role != "rowwise":
            continue
        bias = walk.forms[node][2]
        if isinstance(bias, fx.Node) and walk.needs_grad.get(bias) and (
                node in walk.deferred or node in walk.reduce_scatters):
            pairs.add((node, bias))
    return pairs


def _groups(walk) -> list:
    """[(parameter FQNs, copied values, summed at the step's end?)] of one walk: its groups of values made of
    parameters alone that carry a gradient (``walk._param_only``), joined where one reads another."""
    made = [n for n in walk.graph.nodes if n.op != "output" and walk.needs_grad.get(n) and walk._param_only(n)]
    inside = set(made)
    parent = {n: n for n in made}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    copied = _copied_reads(walk)
    leaving: dict = {}  # group root -> (copied values, a replicated read found)
    for node in made:
        for user in node.users:
            if user in inside:
                parent[find(user)] = find(node)
    for node in made:
        root = find(node)
        values, replicated = leaving.get(root, (set(), False))
        for user in node.users:
            if user in inside:
                continue
            if (user, node) in copied:
                values.add(node)
            elif user.op == "output" or walk.needs_grad.get(user) or user in walk.shard:
                replicated = True  # a gradient reaches this group other than through a copy
        leaving[root] = (values, replicated)
    out = []
    for root, (values, replicated) in leaving.items():
        fqns = {walk.fqn_of[n.name] for n in made if find(n) is root and n.op == "placeholder"}
        if fqns:
            out.append((fqns, values, bool(values) and not replicated))
    return out


def mark(walks: list) -> set:
    """Sets each walk's ``partial_grads`` (the values it reads through ``tp_copy`` whose copy is dropped) and
    ``partial_params`` (their parameters' FQNs); returns every such FQN. A parameter is partial only where every
    group holding it, in every walk, is summed at the step's end."""
    found = [(walk, _groups(walk)) for walk in walks]
    partial = {fqn for _walk, groups in found for fqns, _values, ok in groups if ok for fqn in fqns}
    changed = True
    while changed:  # a group is summed late only where all its parameters are, in every walk
        changed = False
        for _walk, groups in found:
            for fqns, _values, ok in groups:
                if fqns & partial and (not ok or not fqns <= partial):
                    partial -= fqns
                    changed = True
    for walk, groups in found:
        walk.partial_grads = {v for fqns, values, ok in groups if ok and fqns <= partial for v in values}
        walk.partial_params = {fqn for fqns, _values, ok in groups if ok and fqns <= partial for fqn in fqns}
    return partial


def partial_values(walk) -> set:
    """The values ``walk`` reads through a copy that is dropped (:func:`mark`; none before it ran)."""
    return getattr(walk, "partial_grads", set())
