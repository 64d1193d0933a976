"""A model's repeated layers, planned once: a graph folded to a few copies of each run of identical blocks, and
what was decided on the folded graph mapped back onto every copy.

The split marks every node with its segment (``split.partition.SEGMENT``: a repeated block such as
``model.layers.7``, or a top-level module). Two consecutive segments are the same block when their nodes are the
same ops on the same shapes and dtypes, wired the same way: to each other's nodes by position, to the segment before
by position, to the same nodes outside, and to parameters of the same name under their block
(``self_attn.q_proj.weight``). A run of such blocks ``b2 .. bn`` (``b1``, whose predecessor is not a block of its
kind, starts it) is folded to ``b1, b2, b3, bn``: ``b4 .. b(n-1)`` are left out and ``bn`` reads what it read of
``b(n-1)`` from ``b3``. A walk of the folded graph decides ``b3`` as it would decide every block in the middle of the
run, provided it decided ``b3`` as it decided ``b2`` (the steady state: :func:`steady`); :func:`expand` then maps every
decision about ``b3`` onto ``b4 .. b(n-1)`` and the rest onto the nodes they came from. The work of a walk is then
the folded graph's: the same for 8 layers as for 126.

A run is folded only where nothing but the next block reads a left-out block's values (no skip connection across
layers, no hidden state collected for the output).
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

SEGMENT = "tracepp_segment"  # (as split.partition.SEGMENT; partition imports this module's users, not the reverse)
ENABLED = True  # False walks every block (the tests hold the folded plans against it)
KEEP = 3  # copies of a run kept before its last: b1 (the run's first, read from what comes before), b2, b3
MIN_LEFT_OUT = 1


_MEMO: Optional[dict] = None  # inside :func:`remembered`: (what, ids of the arguments) -> (the arguments, answer)


@contextlib.contextmanager
def remembered():
    """Within it, :func:`fold`, :func:`graph_signature` and :func:`graph_maps` answer once per argument (by
    identity): for a planner that settles the same unchanged graphs many times (``tensor_parallel.settle``'s
    trials of low-rank pairs: 15 settles of DeepSeek-V3's 16 stage graphs). The graphs must not change inside."""
    global _MEMO
    outer = _MEMO
    if outer is None:
        _MEMO = {}
    try:
        yield
    finally:
        _MEMO = outer


def _memo(what: str, compute, *args):
    if _MEMO is None:
        return compute(*args)
    key = (what,) + tuple(id(a) for a in args)
    if key not in _MEMO:
        _MEMO[key] = (args, compute(*args))  # the arguments held: their ids stay theirs
    return _MEMO[key][1]


@dataclass
class Folded:
    """A graph with its runs folded, and the way back. ``back``: folded node -> the original node (b3's to b3's);
    ``copies``: per left-out block index i (b4 .. b(n-1), in order) the map of the folded nodes it copies (b3's
    -> b_i's, b2's -> b_(i-1)'s); ``last``: b3's -> b(n-1)'s, used for what bn reads; ``names`` and ``fqns``: the
    same maps over node names and parameter FQNs (strings)."""

    graph: fx.Graph
    original: fx.Graph
    back: dict
    copies: list = field(default_factory=list)  # [(node map, string map)] per left-out block
    last: tuple = None  # (node map, string map) of bn's reads of b3 -> b(n-1)
    steady_pairs: list = field(default_factory=list)  # [(b2 folded node, b3 folded node)] per position
    anchors: dict = field(default_factory=dict)  # folded node / name / fqn -> "b3" | "bn"
    left_out: int = 0
    order: dict = field(default_factory=dict)  # original node -> its position in the original graph


def _segments(graph: fx.Graph) -> list:
    """[(segment index, [nodes])] of the graph's marked compute nodes, consecutive runs of one index."""
    out = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        index = node.meta.get(SEGMENT)
        if out and out[-1][0] == index:
            out[-1][1].append(node)
        else:
            out.append((index, [node]))
    return out


_UNBACKED = re.compile(r"\bu\d+\b")  # a size only known at run time (tokens routed to an expert): one per layer


def _shape(val, local: dict):
    """A value's shape and dtype; the symbols of sizes a block finds at run time renamed by their order of
    appearance in the block (``local``), since every layer has its own."""
    def dim(d) -> str:
        return _UNBACKED.sub(lambda m: local.setdefault(m.group(0), f"u#{len(local)}"), str(d))

    if isinstance(val, torch.Tensor):
        return ("T", tuple(dim(d) for d in val.shape), str(val.dtype), val.requires_grad)
    if isinstance(val, (list, tuple)):
        return tuple(_shape(v, local) for v in val)
    if isinstance(val, (torch.SymInt, torch.SymFloat)):
        return ("V", dim(val))
    if isinstance(val, (int, float, bool)):
        return ("V", type(val).__name__)
    return type(val).__name__


def _relative(fqn: Optional[str], begins: Optional[str]) -> Optional[str]:
    """A state tensor's name under the block it belongs to (``self_attn.q_proj.weight``), or None."""
    if fqn is None or not begins:
        return None
    for prefix in (begins + ".", begins.replace(".", "_") + "_"):
        if fqn.startswith(prefix):
            return fqn[len(prefix):]
    return None


_EXPORTED_STATE = re.compile(r"^(?:p|b|c)_(.+)$")  # export names a state placeholder p_/b_/c_ + its FQN's words


def _state_name(node: fx.Node, fqn_of: dict) -> Optional[str]:
    """The FQN (or export's spelling of it) of a state placeholder: a parameter's from ``fqn_of``, a stage
    graph's from the split's record, else from export's name."""
    if node.name in fqn_of:
        return fqn_of[node.name]
    if node.meta.get("tracepp_fqn"):
        return node.meta["tracepp_fqn"]
    found = _EXPORTED_STATE.match(node.name)
    return found.group(1) if found else None


def _signature(nodes: list, before: list, fqn_of: dict, begins: Optional[str]) -> Optional[tuple]:
    """The structure of a segment's ``nodes`` read against the segment ``before`` it (see the module doc)."""
    position = {node: index for index, node in enumerate(nodes)}
    previous = {node: index for index, node in enumerate(before)}

    def node_ref(item):
        if item in position:
            return ("i", position[item])
        if item in previous:
            return ("p", previous[item])
        if item.op == "placeholder":
            relative = _relative(_state_name(item, fqn_of), begins)
            return ("w", relative) if relative is not None else ("x", item.name)
        return ("x", item.name)

    out, local = [], {}
    for node in nodes:
        out.append((node.op, str(node.target), _structure(node.args, node_ref), _structure(node.kwargs, node_ref),
                    _shape(node.meta.get("val"), local)))
    return tuple(out)


def _structure(item, node_ref):
    """An argument's structure, hashable: containers kept, each node as ``node_ref`` names it, the rest by repr."""
    if isinstance(item, fx.Node):
        return node_ref(item)
    if isinstance(item, (list, tuple)):
        return (type(item).__name__,) + tuple(_structure(i, node_ref) for i in item)
    if isinstance(item, dict):
        return ("d",) + tuple((k, _structure(v, node_ref)) for k, v in item.items())
    if isinstance(item, slice):
        return ("s", _structure(item.start, node_ref), _structure(item.stop, node_ref), _structure(item.step, node_ref))
    return repr(item)


def fold(graph: fx.Graph, fqn_of: dict, begins: dict) -> Optional[Folded]:
    """``graph`` with its longest runs of identical blocks folded (see the module doc), or None where it has no run
    long enough to leave a block out. ``fqn_of``: placeholder name -> parameter FQN; ``begins``: segment index ->
    the module the segment begins at (``model.layers.7``)."""
    if not ENABLED:
        return None
    return _memo("fold", _fold, graph, fqn_of, begins)


def _fold(graph: fx.Graph, fqn_of: dict, begins: dict) -> Optional[Folded]:
    segments = _segments(graph)
    if len(segments) < KEEP + 2:
        return None
    sigs = [None] + [_signature(nodes, segments[k - 1][1], fqn_of, begins.get(index))
                     for k, (index, nodes) in enumerate(segments) if k > 0]
    best = None  # (start k of b2, end k of bn) of the longest run
    k = 1
    while k < len(segments):
        if segments[k][0] is None or begins.get(segments[k][0]) is None:
            k += 1
            continue
        end = k
        while end + 1 < len(segments) and sigs[end + 1] == sigs[k] and segments[end + 1][0] is not None:
            end += 1
        if best is None or end - k > best[1] - best[0]:
            best = (k, end)
        k = end + 1
    if best is None:
        return None
    first, last = best  # b2 = segments[first], bn = segments[last]
    b2, b3 = first, first + 1
    left_out = list(range(first + 2, last))  # b4 .. b(n-1)
    if len(left_out) < MIN_LEFT_OUT:
        return None
    dropped = {node for k in left_out for node in segments[k][1]}
    # nothing but the next block reads a left-out block
    allowed = {k: set(segments[k][1]) | set(segments[k + 1][1]) for k in left_out}
    for k in left_out:
        for node in segments[k][1]:
            if any(user not in allowed[k] for user in node.users):
                return None
    # b3's nodes stand for b(n-1)'s where bn reads them
    redirect = dict(zip(segments[last - 1][1], segments[b3][1]))
    used = set()
    for node in graph.nodes:
        if node not in dropped:
            used.update(node.all_input_nodes)
    new = fx.Graph()
    env: dict = {}
    for node in graph.nodes:
        if node in dropped or (node.op == "placeholder" and node not in used and node.users):
            continue
        env[node] = new.node_copy(node, lambda n: env[redirect.get(n, n)])
        env[node].meta = node.meta
    back = {folded: original for original, folded in env.items()}
    result = Folded(new, graph, back, left_out=len(left_out),
                    order={node: position for position, node in enumerate(graph.nodes)})

    def string_map(source_nodes: list, target_nodes: list, source_begins, target_begins) -> dict:
        strings = {s.name: t.name for s, t in zip(source_nodes, target_nodes)}
        for s, t in zip(source_nodes, target_nodes):  # the parameters each block reads
            for a, b in zip(s.all_input_nodes, t.all_input_nodes):
                if a.op == "placeholder" and a.name in fqn_of and b.name in fqn_of:
                    strings[fqn_of[a.name]] = fqn_of[b.name]
                    strings[a.name] = b.name
        return strings

    nodes3 = [env[n] for n in segments[b3][1]]
    nodes2 = [env[n] for n in segments[b2][1]]
    for k in left_out:
        node_map = dict(zip(nodes3, segments[k][1]))
        node_map.update(zip(nodes2, segments[k - 1][1]))
        node_map.update({env[p]: q for p, q in _params(segments[b3][1], segments[k][1])})
        node_map.update({env[p]: q for p, q in _params(segments[b2][1], segments[k - 1][1]) if p in env})
        strings = string_map(segments[b3][1], segments[k][1], None, None)
        strings.update(string_map(segments[b2][1], segments[k - 1][1], None, None))
        result.copies.append((node_map, strings))
    node_map = dict(zip(nodes3, segments[last - 1][1]))
    node_map.update({env[p]: q for p, q in _params(segments[b3][1], segments[last - 1][1])})
    result.last = (node_map, string_map(segments[b3][1], segments[last - 1][1], None, None))
    result.steady_pairs = list(zip(nodes2, nodes3))
    for node in nodes3:
        result.anchors[node] = "b3"
        result.anchors[node.name] = "b3"
    own = set(segments[b3][1])
    for p, _q in _params(segments[b3][1], segments[b3][1]):
        if all(user in own for user in p.users):  # b3's own parameters (not one every block reads)
            result.anchors[env[p]] = "b3"
            result.anchors[p.name] = "b3"
            if p.name in fqn_of:
                result.anchors[fqn_of[p.name]] = "b3"
    for node in segments[last][1]:
        result.anchors[env[node]] = "bn"
        result.anchors[node.name] = "bn"
    return result


def steady(folded: Folded, *decisions: dict) -> bool:
    """Whether each of ``decisions`` (folded node -> what a walk decided) says the same of b3's nodes as of b2's:
    then every block in the middle of the run is decided as b3 is."""
    return all(d.get(a) == d.get(b) for a, b in folded.steady_pairs for d in decisions)


def _params(source: list, target: list) -> list:
    """[(source parameter placeholder, target's)] read at the same place by two blocks of one run."""
    pairs, seen = [], set()
    for s, t in zip(source, target):
        for a, b in zip(s.all_input_nodes, t.all_input_nodes):
            if a.op == "placeholder" and b.op == "placeholder" and a not in seen:
                seen.add(a)
                pairs.append((a, b))
    return pairs


def _mentions(value, anchors: dict, found: set) -> None:
    if isinstance(value, (fx.Node, str)):
        try:
            kind = anchors.get(value)
        except TypeError:
            kind = None
        if kind:
            found.add(kind)
    elif isinstance(value, dict):
        for k, v in value.items():
            _mentions(k, anchors, found)
            _mentions(v, anchors, found)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            _mentions(item, anchors, found)
    elif isinstance(value, slice):
        for item in (value.start, value.stop, value.step):
            _mentions(item, anchors, found)


_LEAVES = (int, float, bool, type(None))  # values with nothing in them to map


def _remap(value, nodes: dict, strings: dict):
    kind = type(value)  # the exact types first: a walk holds about a million of them at DeepSeek-V3's size
    if kind is fx.Node:
        return nodes.get(value, value)
    if kind in _LEAVES:
        return value
    if kind is str:
        return strings.get(value, value)
    if kind is tuple:
        return tuple([_remap(v, nodes, strings) for v in value])
    if kind is dict:
        return {_remap(k, nodes, strings): _remap(v, nodes, strings) for k, v in value.items()}
    if isinstance(value, fx.Node):
        return nodes.get(value, value)
    if isinstance(value, str):
        return strings.get(value, value)
    if isinstance(value, tuple):
        return tuple(_remap(v, nodes, strings) for v in value)
    if isinstance(value, list):
        return [_remap(v, nodes, strings) for v in value]
    if isinstance(value, frozenset):
        return frozenset(_remap(v, nodes, strings) for v in value)
    if isinstance(value, set):
        return {_remap(v, nodes, strings) for v in value}
    if isinstance(value, dict):
        return {_remap(k, nodes, strings): _remap(v, nodes, strings) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_remap(value.start, nodes, strings), _remap(value.stop, nodes, strings),
                     _remap(value.step, nodes, strings))
    return value


def _entries(value):
    """The pieces of a container a decision is made of: (key, value) of a dict, the items of a list or set."""
    if isinstance(value, dict):
        return list(value.items()), "dict"
    if isinstance(value, list):
        return list(value), "list"
    if isinstance(value, (set, frozenset)):
        return list(value), "set"
    return None, None


def expand_value(value, folded: Folded):
    """A walk's attribute, decided on the folded graph, for the original graph: each entry that mentions a node,
    a node's name or a parameter FQN of b3 repeated for every left-out block (mapped onto it), an entry about bn
    read with b(n-1) where it says b3, every node mapped back to the node it came from."""
    items, kind = _entries(value)
    back = folded.back
    if items is None:
        return _remap(value, back, {})
    out = {} if kind == "dict" else ([] if kind == "list" else set())

    def add(entry, nodes: dict, strings: dict):
        mapped = _remap(entry, nodes, strings)
        mapped = _remap(mapped, back, {})
        if kind == "dict":
            out[mapped[0]] = mapped[1]
        elif kind == "list":
            out.append(mapped)
        else:
            out.add(mapped)

    for entry in items:
        found: set = set()
        _mentions(entry, folded.anchors, found)
        if "bn" in found:  # bn's reads of b3 were of b(n-1)
            add(entry, *folded.last)
            continue
        add(entry, {}, {})
        if "b3" in found:
            for nodes, strings in folded.copies:
                add(entry, nodes, strings)
    return _in_graph_order(out, folded.order)


def _latest(value, order: dict) -> int:
    """The graph position of the latest node an entry mentions (-1: none), where the walk decided it."""
    if isinstance(value, fx.Node):
        return order.get(value, -1)
    if isinstance(value, dict):
        return max([_latest(k, order) for k in value] + [_latest(v, order) for v in value.values()], default=-1)
    if isinstance(value, (list, tuple, set, frozenset)):
        return max((_latest(v, order) for v in value), default=-1)
    return -1


def _in_graph_order(out, order: dict):
    """Entries sorted as an unfolded walk makes them, in the order of the nodes it visits (a dict by its key's
    node where the key is one), so that what is rewritten from them is named alike."""
    if isinstance(out, dict):
        keys = sorted(out, key=lambda k: order.get(k, -1) if isinstance(k, fx.Node) else _latest(out[k], order))
        return {k: out[k] for k in keys}
    if isinstance(out, list):
        return sorted(out, key=lambda entry: _latest(entry, order))
    return out


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def expand_texts(texts: list, folded: Folded) -> list:
    """Lines that name nodes (a walk's reasons: ``softmax_3 ... needs the whole of to_37``) for the original
    graph: each run of lines naming b3's nodes followed by the same lines for every left-out block, in turn (as
    a walk of every block meets them), a line of bn's naming what it read of b(n-1)."""
    out, pending = [], []

    def rename(text: str, strings: dict) -> str:
        return _WORD.sub(lambda m: strings.get(m.group(0), m.group(0)), text)

    def flush():
        out.extend(pending)
        for _nodes, strings in folded.copies:
            out.extend(rename(text, strings) for text in pending)
        pending.clear()

    for text in texts:
        kinds = {folded.anchors.get(word) for word in _WORD.findall(text)}
        if "bn" in kinds:
            flush()
            out.append(rename(text, folded.last[1]))
        elif "b3" in kinds:
            pending.append(text)
        else:
            flush()
            out.append(text)
    flush()
    return out


def expand_object(obj, folded: Folded, original_attrs: dict):
    """A copy of ``obj`` (a walk) with every attribute :func:`expand_value`'d, and ``original_attrs`` (the graph,
    its maps by original node) set as given."""
    new = object.__new__(type(obj))
    for name, value in vars(obj).items():
        if name in original_attrs:
            setattr(new, name, original_attrs[name])
        elif name == "reasons":
            setattr(new, name, expand_texts(value, folded))
        else:
            setattr(new, name, expand_value(value, folded))
    return new


def expand_keys(mapping: dict, folded: Folded) -> dict:
    """A dict keyed by FQNs (or names) learned on the folded graph, with b3's keys repeated for every left-out
    block's parameters."""
    out = dict(mapping)
    for key, value in mapping.items():
        if folded.anchors.get(key) == "b3":
            for _nodes, strings in folded.copies:
                out.setdefault(strings.get(key, key), rename_words(value, strings))
    return out


# -- whole graphs of the same structure (a pipeline's middle stages) ------------------------------------------------

def graph_signature(graph: fx.Graph) -> tuple:
    """The structure of a whole graph: every node's op, target, arguments (other nodes by position) and value
    shape; two stage graphs of the same layers' kinds (a pipeline's middle) have the same."""
    return _memo("signature", _graph_signature, graph)


def _graph_signature(graph: fx.Graph) -> tuple:
    position = {node: index for index, node in enumerate(graph.nodes)}

    def node_ref(item):
        return ("n", position[item])

    local: dict = {}
    return tuple((node.op, str(node.target) if node.op != "placeholder" else "", _structure(node.args, node_ref),
                  _structure(node.kwargs, node_ref), _shape(node.meta.get("val"), local)) for node in graph.nodes)


def graph_maps(source: fx.Graph, target: fx.Graph, fqn_of_source: dict, fqn_of_target: dict) -> tuple:
    """(node map, string map) from one graph to another of the same signature: nodes by position, their names,
    and the FQNs of the parameters read at the same placeholder."""
    return _memo("maps", _graph_maps, source, target, fqn_of_source, fqn_of_target)


def _graph_maps(source: fx.Graph, target: fx.Graph, fqn_of_source: dict, fqn_of_target: dict) -> tuple:
    nodes = dict(zip(source.nodes, target.nodes))
    strings = {a.name: b.name for a, b in nodes.items()}
    for a, b in nodes.items():
        if a.op == "placeholder" and a.name in fqn_of_source and b.name in fqn_of_target:
            strings[fqn_of_source[a.name]] = fqn_of_target[b.name]
    return nodes, strings


def rename_words(value, strings: dict):
    """``value`` with every word of its strings (names, FQNs, within sentences too) mapped by ``strings``."""
    if isinstance(value, str):
        return _WORD.sub(lambda m: strings.get(m.group(0), m.group(0)), value)
    if isinstance(value, (list, tuple)):
        return type(value)(rename_words(v, strings) for v in value)
    if isinstance(value, (set, frozenset)):
        return type(value)(rename_words(v, strings) for v in value)
    if isinstance(value, dict):
        return {rename_words(k, strings): rename_words(v, strings) for k, v in value.items()}
    return value


def map_object(obj, nodes: dict, strings: dict, keep: dict):
    """A copy of ``obj`` (a walk of one graph) for another graph of the same structure: every node and name
    mapped; ``keep`` (attribute -> value) set as given."""
    new = object.__new__(type(obj))
    for name, value in vars(obj).items():
        if name in keep:
            setattr(new, name, keep[name])
        elif name == "reasons":
            setattr(new, name, [_WORD.sub(lambda m: strings.get(m.group(0), m.group(0)), text) for text in value])
        else:
            setattr(new, name, _remap(value, nodes, strings))
    return new


def walk_once(graph: fx.Graph, fqn_of: dict, begins: Optional[dict], build, decided, keep: dict):
    """A single-pass walk of ``graph`` made on its folded graph where it folds: ``build(g, into)`` walks the graph
    ``g`` (``into``: original node -> g's node, to carry per-node inputs over); ``decided(walk)`` gives the
    decisions (node -> placement dicts) that must be the same on b3 as on b2; the walk is then expanded onto every
    block (``keep``: attributes of the original graph to set as given). Unfolded where it does not fold or is
    not steady."""
    folding = fold(graph, fqn_of, begins) if begins else None
    if folding is None:
        return build(graph, lambda node: node)
    into = {original: new for new, original in folding.back.items()}
    walk = build(folding.graph, into.get)
    if not steady(folding, *decided(walk)):
        return build(graph, lambda node: node)
    return expand_object(walk, folding, keep)
