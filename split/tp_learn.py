"""What one pass of the tensor-parallel walks learns for the next (``tp_settle``'s fixed point walks the stages again
until none of these changes): parameters read only at a rank's piece, held as pieces (:func:`_learn_pieces`); whole
values made on a piece, or row-wise sums reduce-scattered to it, where only a piece is read
(:func:`_learn_local_sources`); fused projections' segments
(:func:`_learn_segments`) and the parts needed whole (:func:`_learn_whole_parts`)."""
from __future__ import annotations

import torch

from tracepp.split import rules
from tracepp.split.rules import at as _at, equal as _equal, ints as _ints, val as _val
from tracepp.split.derived_weights import dim_before
from tracepp.split.tp_contract import widens
from tracepp.split.tp_walk import _Walk

aten = torch.ops.aten


def _piece_of(walk: _Walk, node, dim):
    """(placeholder, dim) of the one parameter that ``node`` is made from by ops of one input that keep its sizes apart from
    dims of 1 (casts, ``exp``, ``neg``, ``unsqueeze``: Mamba's ``-exp(A_log.float())[None, :, None, :]``, a bias
    ``[:, None]``), transposes and views that split it into heads, with ``dim`` of ``node`` traced back to the
    parameter's dim; else None."""
    while True:
        if node.op == "placeholder":
            return (node, dim) if node.name in walk.fqn_of else None
        if node.op != "call_function":
            return None
        if node.target is aten.embedding.default and _val(node) is not None:  # a table's columns, picked at
            # indices the model computes (CPM-Ant's relative position bias per head, at buckets of distances), never
            # at the batch's token ids: a vocabulary stays vocabulary-parallel
            if dim != _val(node).dim() - 1 or len(node.all_input_nodes) != 2 or not walk._computed_index(node.args[1]):
                return None
            node, dim = node.args[0], 1
            continue
        if len(node.all_input_nodes) == 2 and rules.family(node.target) == "elementwise":
            source = _broadcast_beside(node, dim)  # AdaLoRA's lora_A * lora_E ([r, in] by [r, 1]), a scale per row
            if source is None:
                return None
            node, dim = source
            continue
        if len(node.all_input_nodes) != 1:
            return None
        source = node.all_input_nodes[0]
        out_val, in_val = _val(node), _val(source)
        if not (isinstance(out_val, torch.Tensor) and isinstance(in_val, torch.Tensor)):
            return None
        if node.target in rules.TRANSPOSES or node.target in rules.VIEWS:  # Inkling 2's static_weight.T.view(heads,
            before = dim_before(node, dim, walk.tp)                            # -1, k)
            if before is None:
                return None
            node, dim = source, before
            continue
        outs = [i for i, size in enumerate(out_val.shape) if not _equal(size, 1)]
        ins = [i for i, size in enumerate(in_val.shape) if not _equal(size, 1)]
        if (len(outs) != len(ins) or dim not in outs
                or not all(_equal(out_val.shape[a], in_val.shape[b]) for a, b in zip(outs, ins))):
            return None
        node, dim = source, ins[outs.index(dim)]


def _broadcast_beside(node, dim: int):
    """(operand, its dim) of an elementwise op of two tensors where that operand alone is as wide as the output at
    ``dim`` and of the output's shape (the other broadcast along ``dim``: a size of 1 there, or no such dim): the
    output's piece at ``dim`` is that operand's piece times the other, read whole; else None."""
    out = _val(node)
    found = []
    for arg in node.all_input_nodes:
        val = _val(arg)
        if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor):
            return None
        at = dim - (out.dim() - val.dim())
        if at >= 0 and not _equal(val.shape[at], 1):
            found.append((arg, at))
    if len(found) != 1:
        return None
    arg, at = found[0]
    val = _val(arg)
    if val.dim() != out.dim() or not all(_equal(a, b) for a, b in zip(val.shape, out.shape)):
        return None
    return arg, at


def _learn_pieces(walks: list, pieces: dict, notes: dict) -> bool:
    """Parameters that a pass reads only at this rank's piece, through values made from them alone (Mamba's
    ``A_log``, ``D``, its convolution's weight, ``dt_proj``'s bias added on its own): sharded where they are made
    (``pieces``: fqn -> dim), so each rank holds its piece and computes on it; the next pass walks them sharded.
    One that is read whole elsewhere becomes "used sharded in one place and whole in another" and is replicated."""
    learned = False
    for walk in walks:
        repieced = {}  # held in pieces of other segments than the channels it meets: held again in theirs
        for arg, segments in walk.repieces.items():
            found = _piece_of(walk, arg, walk.shard[arg])
            if found is not None:
                repieced[walk.fqn_of[found[0].name]] = found[1] if segments is None else (found[1], segments)
        for consumer, arg in walk.gathers:  # a piece made whole again (its reader's input was whole after all)
            found = _piece_of(walk, arg, walk.shard[arg]) if arg in walk.shard else None
            fqn = walk.fqn_of[found[0].name] if found is not None else None
            if fqn in pieces and fqn not in notes and fqn not in repieced:
                notes[fqn] = f"read whole by {consumer.target}{_at(consumer)}, where the value it makes meets whole ones"
                learned = True
        for _consumer, arg, dim, groups in walk.scatters:
            if not isinstance(dim, int) or not walk._param_only(arg):
                continue
            found = _piece_of(walk, arg, dim)
            if found is None:
                continue
            placeholder, at = found
            fqn, size = walk.fqn_of[placeholder.name], _val(placeholder).shape[at]
            segments = _piece_segments(groups, size, _val(arg).shape[dim], walk.tp)
            if fqn not in notes and fqn not in pieces and segments is not False:
                pieces[fqn] = at if segments is None else (at, segments)
                learned = True
        for fqn, placed in repieced.items():
            if fqn not in notes and pieces.get(fqn) != placed:
                pieces[fqn] = placed
                learned = True
    return learned


def _learn_local_sources(walks: list, sources: list) -> bool:
    """Values every rank computes whole only for each to read its piece of them (a ``tp_scatter`` of a whole value
    that is not made from parameters alone): where the ops that make them keep each index of the read dim apart
    and start from an expand or ``repeat_interleave`` of a dim of 1 (Mamba-2's chunked scan: B and C of one group
    repeated to every head, their scores ``einsum("bclhn,bcshn->bclsh")`` of every head computed whole and read at
    this rank's heads), or from a row-wise linear's sum read at heads (x-transformers' output gate over the merged
    heads: its sum reduce-scattered, ``tp_contract._scatter_features``), those starts are made on the piece and the
    rest runs on it (``sources``: per graph, node name -> dim). Every value on the way must be read at that piece
    alone."""
    learned = False
    for walk, found in zip(walks, sources):
        reads = {(consumer, arg, dim) for consumer, arg, dim, _groups in walk.scatters}
        for _consumer, arg, dim, groups in walk.scatters:
            if groups != 1 or not isinstance(dim, int) or walk._param_only(arg):
                continue
            starts = _local_tree(walk, arg, dim, reads)
            if starts and any(found.get(node.name) != at for node, at in starts.items()):
                found.update({node.name: at for node, at in starts.items()})
                learned = True
    return learned


def _local_tree(walk: _Walk, value, dim: int, reads: set):
    """{expand or repeat of a dim of 1: the dim it makes; or row-wise linear: its output's features, reduce-scattered}
    from which ``value``, read at this rank's piece of ``dim``, can be computed on the piece; None where some op on
    the way mixes the dim's indices or some value on the way is read otherwise than at that piece (``reads``:
    (reader, value, dim) of the walk's reads at a piece)."""
    at: dict = {}
    starts: dict = {}
    todo = [(value, dim)]
    while todo:
        node, d = todo.pop()
        if node in at:
            if at[node] != d:
                return None
            continue
        val = _val(node)
        if (not isinstance(node, torch.fx.Node) or node.op != "call_function" or node in walk.shard
                or not isinstance(val, torch.Tensor) or not _ints([val.shape[d]]) or int(val.shape[d]) % walk.tp):
            return None
        at[node] = d
        target, first = node.target, node.args[0]
        first_val = _val(first) if isinstance(first, torch.fx.Node) else None
        if walk.roles.get(node) == "rowwise":
            # its partial sums reduce-scattered over the features it is read at, where that read is at heads (a dim
            # before the last: the gate's [b, h, n, d] beside each rank's heads), not at a stream's features (LoRA's
            # frozen base output beside a sharded adapter's: a row-wise pair, the stream whole); and not where it
            # widens: a low-rank pair's up-projection, which the cost trials make column-wise (Kimi Linear's output
            # gate, g_b_proj after g_a_proj)
            # (a convolution's features are its channels, dim 1)
            features = 1 if node.target in rules.CONVS else val.dim() - 1
            if (d != features or dim >= _val(value).dim() - 1 or walk.forms[node][2] is not None
                    or node in walk.reduce_scatters or node.target not in (aten.linear.default, *rules.CONVS)
                    or widens(walk.forms[node])):
                return None
            starts[node] = d
        elif target in rules.EXPANDS or target is aten.repeat_interleave.self_int:
            inner = d - (val.dim() - first_val.dim()) if isinstance(first_val, torch.Tensor) else -1
            if target is aten.repeat_interleave.self_int and (rules.arg(node, 2, "dim") is None
                                                               or not isinstance(node.args[1], int)):
                return None  # flattened, or a count the rewrite cannot make this rank's
            if target in rules.EXPANDS and not walk._local_size(node.args[1], d, val.shape[d]):
                return None
            if inner >= 0 and not _equal(first_val.shape[inner], 1):
                return None  # the expanded or repeated dim is not one of 1
            starts[node] = d
        elif target in rules.UNARY:
            todo.append((first, d))
        elif target in rules.PADS:
            pad, k = list(node.args[1]), 2 * (val.dim() - 1 - d)  # (before, after) of the last dim first
            if k < len(pad) and (pad[k] != 0 or pad[k + 1] != 0):
                return None  # padded along the dim
            todo.append((first, d))
        elif target in rules.VIEWS or target in rules.TRANSPOSES:
            before = dim_before(node, d, walk.tp)
            if before is None:
                return None
            todo.append((first, before))
        elif target is aten.einsum.default:
            labels = rules.einsum_labels(node)
            if labels is None:
                return None
            specs, output = labels
            for spec, operand in zip(specs, node.args[1]):
                if output[d] in spec:
                    todo.append((operand, spec.index(output[d])))
        elif target in rules.BINARY:
            for operand in node.all_input_nodes:
                operand_val = _val(operand)
                e = d - (val.dim() - operand_val.dim())
                if e >= 0 and not _equal(operand_val.shape[e], 1):
                    todo.append((operand, e))
        else:
            return None
    for node, d in at.items():  # nothing on the way is read whole
        for user in node.users:
            if user in at or user.target in rules.IGNORED:
                continue
            if (user, node, d) not in reads:
                return None
    return starts


def _piece_segments(groups, size, read_size, tp: int):
    """The segments of a parameter held as a piece, read at ``groups`` (1: one piece; a count of equal segments
    or their sizes: a depthwise convolution's weight over a fused projection's x, B and C, each read at its piece):
    None for one piece, a tuple of sizes, or False where a piece cannot be held (a size ``tp`` does not divide, or a
    parameter whose dim is not the one read)."""
    if not _ints([size]) or int(size) % tp:
        return False
    if groups == 1:
        return None
    if not _ints([read_size]) or int(read_size) != int(size):
        return False
    segments = tuple(int(s) for s in groups) if isinstance(groups, tuple) else (int(size) // groups,) * groups
    return False if any(s % tp for s in segments) else segments


def _learn_segments(walks: list, tp: int, fused: dict, narrow: dict) -> bool:
    """Fold the cut points the walks' consumers need into ``fused`` (weight fqn -> segments); a part ``tp``
    does not divide replicates the projection (into ``narrow``). True when a segment list changed. A point once
    learned is kept (the points only grow, so the passes end): walked with a projection's parts, a consumer may ask
    only for the cuts its parts still lack (ring-attention's fused q, k, v: heads split 4, 2, 2 from a view of
    them, then tiled; asked for 64 | 32 | 32, then for 64 | 64 over it, the segments went back and forth)."""
    learned = False
    for walk in walks:
        for fqn, cuts in walk.wants.items():
            points = sorted(set(cuts) | set(rules.boundaries(fused[fqn]) if fused.get(fqn) else ()))
            segments = tuple(b - a for a, b in zip(points, points[1:]))
            bad = [s for s in segments if s % tp]
            if bad:
                narrow.setdefault(fqn, f"a fused projection with a part of {bad[0]} features, which --tp {tp} "
                                       f"does not divide")
            elif fused.get(fqn) != segments:
                fused[fqn] = segments
                learned = True
    return learned


def _learn_whole_parts(walks: list, fused: dict, mixed: dict, notes: dict, narrow: dict) -> bool:
    """Fold the fused projections' parts found needed whole into ``mixed`` (a projection all of whose parts would
    be whole is replicated instead, into ``narrow``). True when a projection gained a whole part."""
    learned = False
    for walk in walks:
        for fqn, parts in walk.whole_parts.items():
            if fqn in notes or fqn not in fused:
                continue
            have = set(mixed.get(fqn, ())) | parts
            if len(have) >= len(fused[fqn]):
                narrow.setdefault(fqn, "a fused projection none of whose parts has whole heads on each rank")
            elif have != set(mixed.get(fqn, ())):
                mixed[fqn] = have
                learned = True
    return learned
