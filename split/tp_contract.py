"""The tensor-parallel walk's rules for contractions: linears (column-wise, row-wise, fused projections with mixed
parts), embeddings (vocabulary-parallel), batched products and attention in its spellings (sdpa, matmul + softmax,
baddbmm, einsum), gathers and depthwise convolutions: a mixin of ``tp_walk._Walk``."""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from tracepp.split import rules
from tracepp.split.derived_weights import _chains, _rearranged, blocking_step
from tracepp.split.rules import equal as _equal, ints as _ints, sizes as _sizes, val as _val

aten = torch.ops.aten
TP = torch.ops.tracepp


def _swapped(dim: int, ndim: int) -> int:
    """``dim`` of a tensor after its last two dims are swapped."""
    return dim if dim < ndim - 2 else 2 * ndim - 3 - dim


def _in_dim(weight_val, out_dim: int) -> int:
    """The input-feature dim of a linear's weight: the other one of a 2-D weight, dim 1 of a 3-D ``[experts, in,
    out]`` one (Llama 4's experts, each computed on every token by ``bmm``)."""
    return 1 if weight_val.dim() == 3 else 1 - out_dim


def _conv_groups_of(node) -> int:
    """The groups of a convolution read as a linear (1 for any other linear)."""
    return rules.arg(node, 6, "groups", 1) if node.target in rules.CONVS else 1


def linear_widths(form):
    """(input features, output features) of a linear in ``_linear_form``'s form ``(x, weight, bias, out dim)``, or
    None where a width is symbolic."""
    weight = _val(form[1])
    if weight.dim() > 3:  # a weight viewed with batch labels (CoLT5's per-route weight): no plain width
        return None
    inp, outp = weight.shape[_in_dim(weight, form[3])], weight.shape[form[3]]
    return (int(inp), int(outp)) if _ints([inp, outp]) else None


def widens(form) -> bool:
    """A linear whose output features are more than its input features (both static)."""
    widths = linear_widths(form)
    return widths is not None and widths[1] > widths[0]


def narrows(form) -> bool:
    """A linear whose output features are fewer than its input features (both static)."""
    widths = linear_widths(form)
    return widths is not None and widths[1] < widths[0]


class _ContractionRules:
    """Linears, embeddings, products and attention (methods of ``tp_walk._Walk``)."""

    def _weight(self, node) -> bool:
        self._read_through(node)
        return self._param(node) is not None and _val(node).dim() == 2

    def _read_through(self, node) -> None:
        """A linear's weight or bias rearranged from a parameter on every call (:func:`_chain`) is read as that
        parameter: its dims traced back to the parameter's where it is claimed (``_use``)."""
        if self._param(node) is None and isinstance(node, fx.Node) and node.op == "call_function":
            found = _chains(node)
            if found is not None and len(found) > 1 and not all(
                    _rearranged(node, d, self.tp) is not None for d in range(_val(node).dim())):
                found = None  # several parameters, one broadcast along a dim of the weight (AdaLoRA's lora_E
                #               beside lora_A's input features): not one weight, read as the walk finds it
            if found is not None and all(p.name in self.fqn_of for p in found):
                # the largest parameter is the weight's; the others are claimed beside it (KAN-GPT's spline_scaler)
                primary = max(found, key=lambda p: (_val(p).numel(), p.name))
                self.chains[node] = primary
                if len(found) > 1:
                    self.companions[node] = sorted((p for p in found if p is not primary), key=lambda p: p.name)

    def _linear_form(self, node):
        """(input, weight node, bias node or None, the weight node's output-feature dim) of a linear of a 2-D
        parameter in any spelling export keeps, else None."""
        target, args = node.target, node.args
        if target is aten.linear.default and self._weight(args[1]):
            bias = args[2] if len(args) > 2 else None
            self._read_through(bias)
            return args[0], args[1], bias, 0
        if (target is aten.addmm.default and self._weight(args[2]) and not node.kwargs
                and _val(args[1]).dim() == 2 and _val(args[0]).dim() == 1):
            return args[1], args[2], args[0], 1
        if target in (aten.mm.default, aten.matmul.default) and len(args) == 2 and self._weight(args[1]):
            return args[0], args[1], None, 1
        if (target in (aten.mm.default, aten.matmul.default) and len(args) == 2 and self._weight(args[0])
                and self._param(args[1]) is None and _val(args[1]).dim() >= 2):
            return args[1], args[0], None, 0  # W @ x (Mamba's dt_proj.weight @ dt): features on x's dim -2
        if (target in (aten.bmm.default, aten.matmul.default) and len(args) == 2 and self._param(args[1]) is not None
                and _val(args[1]).dim() == 3 and _val(args[0]).dim() == 3):
            return args[0], args[1], None, 2  # x @ W of a 3-D W [experts, in, out]: every expert on its rows
        if target is aten.einsum.default:
            return self._einsum_linear(node)
        if target is aten.conv1d.default and self._channel_linear(node):  # a sum over the input channels (dim 1)
            return args[0], args[1], rules.arg(node, 2, "bias"), 0
        return None

    def _channel_linear(self, node) -> bool:
        """A ``conv1d`` of ``[b, channels, t]`` by a parameter's weight ``[out, in / groups, k]``: each output channel
        a sum over the input channels, as a linear's over its features (dim 1 here), whatever the kernel, stride,
        padding or dilation do along the positions. Row-wise, each rank's sum over its input channels is a partial sum
        of every output channel (the bias added once, after the sum); column-wise, each rank computes its output
        channels. litgpt's LoRA on a fused qkv (``F.conv1d(after_A, lora_B.unsqueeze(-1).split(qkv_shapes)[i])`` per
        part). With groups, a 1 x 1 kernel only: block diagonal (mixture-of-attention's experts, ``Conv1d(dim *
        experts, inner * experts, 1, groups=experts)``), each group's output channels read its input channels only
        (:meth:`_conv_groups`); a depthwise or grouped convolution of a wider kernel (Mamba's causal conv1d) is
        ``_depthwise_conv``'s. Not a ``conv2d``: in a decoder that is x-transformers' talking heads,
        ``Conv2d(heads, heads, 1)`` over the scores ``[b, heads, i, j]``, whose sum over the heads, row-wise, would
        move the scores (b h s^2 per layer, twice) where the whole attention on every rank costs 2 d_head FLOPs
        a score (docs/families.md, thirteenth round: 53,280 against 47,159 by ``plan_cost`` at the traced size)."""
        weight, bias = node.args[1], rules.arg(node, 2, "bias")
        groups = rules.arg(node, 6, "groups", 1)
        if (node.target is not aten.conv1d.default or not isinstance(weight, fx.Node) or _val(node.args[0]).dim() != 3
                or not isinstance(groups, int) or (bias is not None and not isinstance(bias, fx.Node))
                or (groups != 1 and (bias is not None or not rules.pointwise_convolution(node)))):
            return False
        self._read_through(weight)
        self._read_through(bias)
        return self._param(weight) is not None and _val(weight).dim() == 3

    @staticmethod
    def _conv_groups(node, segments, channels):
        """A grouped 1 x 1 convolution's channels (``channels`` of them, in ``groups`` equal blocks) held in
        ``segments``, each rank its piece of each: the segments of one group (None: one), the same in every group, so
        that a rank's channels are a grouped convolution's channels of the same groups; False where they are not
        (a segment across two groups, groups cut differently, no segments)."""
        groups = _conv_groups_of(node)
        if groups == 1:
            return None
        if not segments or not _ints([channels, *segments]) or int(channels) % groups:
            return False  # (a plain shard of grouped channels holds whole groups, not a piece of each)
        width = int(channels) // groups
        cuts, run, group = [], 0, []
        for size in segments:
            group.append(int(size))
            run += int(size)
            if run % width == 0:
                cuts.append(tuple(group))
                group = []
        if group or len(set(cuts)) != 1:
            return False
        return cuts[0] if len(cuts[0]) > 1 else None

    def _einsum_linear(self, node):
        """An ``einsum`` of an activation and a parameter that is a linear (recurrentgemma's ``Einsum``: ``"...td,
        cdD->c...tD"``, Griffin's MLP gate and up projections in one ``[2, d, D]`` weight): ``x``'s last label the
        only one it shares with the weight, summed over; the output's last label the weight's last, ``x`` has not; the
        weight ``[in, out]``, or ``[parts, in, out]`` with its parts kept in the output. In ``_linear_form``'s form,
        else None (attention's products, per-head weights ``"...hd,hod->...ho"``: ``_einsum``)."""
        labels, operands = rules.einsum_labels(node), list(node.args[1])
        if labels is None or len(operands) != 2:
            return None
        (xs, ws), out = labels
        x, weight = operands
        for operand in operands:
            self._read_through(operand)
        if self._param(x) is not None and self._param(weight) is None and x in self.chains:  # the weight first
            return self._batched_einsum_linear(node, weight, x, ws, xs, out)
        if self._param(weight) is None or self._param(x) is not None:
            return None
        wval = _val(weight)
        shared = set(xs) & set(ws)
        if wval.dim() == 2 and shared == {xs[-1]} and len(set(ws)) == 2:  # [in, out] or [out, in], the output's
            feature = ws[1 - ws.index(xs[-1])]                              # feature anywhere (colt5's routing
            if feature in out and set(xs[:-1]) <= set(out) and len(out) == len(xs):  # tokens, "b n d, r d -> b r n")
                return x, weight, None, ws.index(feature)
        if (wval.dim() not in (2, 3) or shared != {xs[-1]} or ws[-2] != xs[-1] or xs[-1] in out or not out
                or out[-1] != ws[-1] or any(label not in out for label in ws[:-2]) or len(set(xs + ws)) != len(
                    xs) + len(ws) - 1 or any(label not in out for label in xs[:-1])):
            return self._batched_einsum_linear(node, x, weight, xs, ws, out)
        return x, weight, None, wval.dim() - 1

    def _batched_einsum_linear(self, node, x, weight, xs: str, ws: str, out: str):
        """An ``einsum`` of a whole activation and a weight derived from one parameter by a view, with batch labels
        both keep (CoLT5's per-route key/value weight: ``rearrange(to_kv.weight, '(r h d) i -> r h d i')`` in
        ``einsum('r h d i, b r n i -> b r h n d')``): one label summed over, the weight's other labels batch labels
        (in ``x`` and the output) or its own output labels. Column-wise on its first own output label (the heads of
        ``(h d)``), in ``_linear_form``'s form; else None."""
        summed = [label for label in ws if label in xs and label not in out]
        own = [label for label in ws if label not in xs]
        if (x in self.shard or weight not in self.chains or len(summed) != 1 or not own
                or any(label not in out for label in own) or len(set(ws)) != len(ws) or len(set(xs)) != len(xs)
                or any(label in ws and label not in out and label != summed[0] for label in xs)):
            return None
        return x, weight, None, ws.index(own[0])

    def _linear(self, node, x, weight, bias, out_dim: int) -> None:
        fqn = self._param(weight)
        wval = _val(weight)
        ndim = len(_val(x).shape)
        groups = _conv_groups_of(node)  # (a grouped 1 x 1 convolution's: block diagonal)
        conv = node.target in rules.CONVS  # a convolution: the features on dim 1 of x and of the output
        left = node.args[0] is weight or conv  # W @ x: the features on x's dim -2 and the output's
        features = 1 if conv else ndim - 2 if left else ndim - 1
        entering = x in self.shard and self.kind.get(x) == "seq"  # a sequence shard entering the region
        if left and entering:
            self._gather(node, x)
            return
        if x in self.shard and not entering:
            segments = self.segs.get(x)
            if self.shard[x] == features and fqn not in self.forced and self._mixed_on_the_way(weight, _in_dim(
                    wval, out_dim)):
                self._gather_all(node)
                return
            if self.shard[x] == features and fqn not in self.forced:
                held = segments
                if groups > 1:  # each group's input channels: the rank's piece of each
                    held = self._conv_groups(node, segments, _val(x).shape[features])
                    if held is False:
                        self._refuse(node, f"a convolution of {groups} groups over channels sharded "
                                           f"{'in segments ' + str(list(segments)) if segments else 'whole groups'}"
                                           f": a rank's channels are not its piece of every group")
                        self._gather_all(node)
                        return
                self.roles[node] = "rowwise"
                self.forms[node] = (x, weight, bias, out_dim)
                self._claim(node, weight, _in_dim(wval, out_dim), held)
                self._scatter_output(node)
                if node.name in self.local_sources and node not in self.reduce_scatters and bias is None:
                    self._scatter_features(node, x, self.local_sources[node.name])
                return
            if not left and self.shard[x] < features and fqn not in self.forced:
                # rows sharded on a dim before the features (Inkling's per-head states @ a bank of profiles; heads
                # merged into the batch, '(b h) n d', whose shard holds each sample's heads: segments): each row's
                # product is its own, the weight whole on every rank, its gradient summed over tp
                for arg in (weight, bias):
                    if isinstance(arg, fx.Node) and self.needs_grad.get(arg, True):
                        self.copies.append((node, arg))
                    self._claimed.add((node, arg))
                self._carry(node, x)
                return
            if fqn not in self.forced:
                self._refuse(node, f"input sharded on dim {self.shard[x]}, not its features")
            self._gather_all(node)
            return
        out_features = wval.shape[out_dim]
        segments = self.fused.get(fqn)
        if groups > 1 and _ints([out_features]) and int(out_features) % groups == 0:  # each group's output channels
            segments = segments or (int(out_features) // groups,) * groups            # a segment at least
            if self._conv_groups(node, segments, out_features) is False or any(int(s) % self.tp for s in segments):
                self.reasons.append(f"{fqn}: a convolution of {groups} groups whose output channels {list(segments)} "
                                    f"--tp {self.tp} cannot cut into a piece of each group")
                if entering:
                    self._gather(node, x)
                return
        if fqn in self.mixed_parts and segments and fqn not in self.forced and not entering:
            return self._mixed_linear(node, x, weight, bias, out_dim, fqn, segments)
        mixed = fqn not in self.forced and self._mixed_on_the_way(weight, out_dim)  # gives its own reason
        if fqn in self.forced or int(out_features) % self.tp or mixed:
            if fqn not in self.forced and not mixed:
                self.reasons.append(f"{fqn}: {out_features} output features, which --tp {self.tp} does not divide")
            if entering:
                self._gather(node, x)
            return
        self.roles[node] = "colwise"
        self.forms[node] = (x, weight, bias, out_dim)
        self.out_features[fqn] = int(out_features)
        self._claim(node, weight, out_dim, segments)
        if bias is not None:
            self._claim(node, bias, 0, segments)
        if entering:  # gathered over the sequence forward, its gradient reduce-scattered backward
            if self.groups_of(self.segs.get(x)):
                self.sp_gathers.append((node, x))
            else:
                self._gather(node, x)
        else:
            self.copies.append((node, x))
        self._claimed.add((node, x))
        dim = 1 if conv else _val(node).dim() - (2 if left else 1)
        if node.target is aten.einsum.default:  # where the weight's output label is in the output
            specs, out = rules.einsum_labels(node)
            dim = out.index(specs[list(node.args[1]).index(weight)][out_dim])
        if fqn in self.gathered and not segments:  # a low-rank down-projection: its narrow output made whole
            self.gathered_out[node] = dim
            self.gathers.extend((user, node) for user in node.users)
            return
        self._place(node, dim, segments, {fqn})

    def _frozen_linear(self, node) -> bool:
        """``F.linear(x, w)`` by a whole 2-D ``w`` that is no parameter and takes no gradient (PEFT's VeRA:
        ``vera_A[:, :in_features]`` and ``vera_B[:out_features, :]``, slices of frozen buffers every layer shares;
        any value every rank holds whole), each rank reading its piece of ``w`` (``tp_scatter``): row-wise where
        ``x`` is sharded on its features (the partial sums all-reduced), column-wise where ``x`` is whole, ``w``
        does not narrow and the output meets a value sharded on its features (the adapter's output added to a
        column-wise projection's), its output sharded."""
        x, weight = node.args[0], node.args[1]
        if (rules.arg(node, 2, "bias") is not None or not isinstance(weight, fx.Node) or weight in self.shard
                or self._param(weight) is not None or self.needs_grad.get(weight, True)):
            return False
        wval, n = _val(weight), _val(node).dim()
        if not isinstance(wval, torch.Tensor) or wval.dim() != 2 or not _ints(list(wval.shape)):
            return False
        out, inp = (int(size) for size in wval.shape)
        if x in self.shard:
            segments = self.segs.get(x)
            if (self.shard[x] != n - 1 or self.kind.get(x) == "seq" or inp % self.tp
                    or self.origin.get(x, frozenset()) & self.forced or (segments and not _ints(segments))):
                return False
            self.scatters.append((node, weight, 1, (self.groups_of(segments) or tuple(segments)) if segments else 1))
            self._claimed.update({(node, weight), (node, x)})
            self.sums[node] = None  # each rank's partial product: all-reduced
            return True
        segments = self._meets_shard(node)
        if out % self.tp or out < inp or segments is None:
            return False
        self.scatters.append((node, weight, 0, (self.groups_of(segments) or segments) if segments else 1))
        self._claimed.update({(node, weight), (node, x)})
        if self.needs_grad.get(x):
            self.copies.append((node, x))
        self._place(node, n - 1, segments or None)
        return True

    def _meets_shard(self, node, depth: int = 4):
        """The segments (``()`` for one) of a value sharded on its last dim that ``node``'s output meets through at
        most ``depth`` elementwise ops (a column-wise projection's output it is added to); None where it meets none."""
        todo = [(node, 0)]
        while todo:
            value, steps = todo.pop()
            for user in value.users:
                if user.op != "call_function" or not rules.is_pointwise(user.target) and user.target not in (
                        rules.UNARY | rules.BINARY):
                    continue
                for a in user.all_input_nodes:
                    if a is not value and a in self.shard and self.shard[a] == _val(a).dim() - 1:
                        segments = self.segs.get(a)
                        return tuple(int(size) for size in segments) if segments and _ints(segments) else ()
                if steps < depth:
                    todo.append((user, steps + 1))
        return None

    def _mixed_on_the_way(self, weight, dim: int) -> bool:
        """A weight derived from its parameter (``chains``) by a step that mixes ``dim`` (normalised over it: nGPT's
        ``NormLinear`` with ``norm_dim_in=False`` read column-wise): the linear cannot take that dim's pieces. The
        step is given as the reason."""
        if weight not in self.chains:
            return False
        step = blocking_step(weight, dim, self.tp)
        if step is not None:
            how = (f"regroups the weight's dim {dim} (the view puts it inside groups of another dim: each rank would "
                   f"hold a piece of each group, which no one dim of the parameter holds)"
                   if step.target in rules.VIEWS else f"mixes the weight's dim {dim}")
            self.reasons.append(f"{self._param(weight)}: read through {rules.op_name(step)}{rules.at(step)}, which "
                                f"{how}")
        return step is not None

    def _mixed_linear(self, node, x, weight, bias, out_dim, fqn, segments) -> None:
        """A fused projection whose key/value parts have fewer heads than --tp (GPTBigCode's multi-query
        ``c_attn``): the query part is column-wise on this rank's heads, the key/value parts are computed whole
        (as Megatron-Core replicates key/value heads). The weight is whole on every rank; the rewrite computes
        the sharded parts from this rank's rows (``tp_scatter`` of their slice: the gradient rows gathered back)
        with the input through ``tp_copy``, and the whole parts from their rows and the input as it is."""
        whole = frozenset(self.mixed_parts[fqn])
        self.mixed_linears[node] = (x, weight, bias, out_dim, tuple(segments), whole)
        self._use(weight, None)
        if bias is not None:
            self._use(bias, None)
        self._claimed.update({(node, weight), (node, x)} | ({(node, bias)} if bias is not None else set()))
        self._place(node, _val(node).dim() - 1, segments, {fqn})
        self.mixed[node] = whole
        self.out_features[fqn] = int(_val(weight).shape[out_dim])

    def _embedding(self, node) -> None:
        weight = node.args[0]
        fqn = self._param(weight)
        extra = list(node.args[3:]) + [v for k, v in node.kwargs.items() if k != "padding_idx"]
        rows = _val(weight).shape[0]
        if fqn in self.forced or any(extra) or _val(weight).dim() != 2 or int(rows) % self.tp:
            if fqn not in self.forced:
                self.reasons.append(f"{fqn}: vocabulary of {rows} rows, which --tp {self.tp} does not divide"
                                    if int(rows) % self.tp else f"{fqn}: a sparse or frequency-scaled embedding")
            self._use(weight, None)
            return
        self.roles[node] = "vocab"
        self._claim(node, weight, 0)
        self._scatter_output(node)

    def _bag_lookup(self, node) -> bool:
        """``embedding_bag`` of a parameter's table in sum mode at whole indices, only its bags' sums read
        (product-key memory's ``values(indices, per_sample_weights=attn)``; its other outputs unread): vocabulary-parallel as an embedding,
        each rank summing its rows' entries (the others' weighted 0, ``tp_vocab_rows``) and ``tp_all_reduce`` summing
        the ranks'; the weights, whole, get their gradient summed over tp."""
        weight = node.args[0]
        fqn, wval = self._param(weight), _val(weight)
        users = [user for user in node.users if user.users or user.target is not operator.getitem]
        get = functools.partial(rules.named, node)
        if (fqn is None or fqn in self.forced or self.sequence is not None or get("mode", 0) != 0
                or get("scale_grad_by_freq", False) or get("sparse", False) or get("padding_idx") not in (None, -1)
                or wval.dim() != 2 or not _ints([wval.shape[0]]) or int(wval.shape[0]) % self.tp
                or len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0):
            return False
        self.bags[node] = users[0]
        self.sums[users[0]] = None  # each rank's bags of its rows: summed over tp
        self._claim(node, weight, 0)
        weights = get("per_sample_weights")
        if isinstance(weights, fx.Node) and self.needs_grad.get(weights):
            self.copies.append((node, weights))
        self._claimed.update((node, arg) for arg in node.all_input_nodes)
        return True

    def _sequence_dim(self, val):
        """(dim, segments) of the sequence in a value (its tokens), or None: a dim of the traced sequence length
        other than the last (the features), or a leading [batch * seq] dim of per-sample segments."""
        if self.sequence is None or not isinstance(val, torch.Tensor) or val.dim() < 2:
            return None
        sizes = _sizes(val)
        seq = self.sequence
        for d in range(val.dim() - 1):
            if _equal(sizes[d], seq):
                return (d, None) if not _ints([seq]) or int(seq) % self.tp == 0 else None
        if _ints([sizes[0], seq]) and int(sizes[0]) % int(seq) == 0 and int(seq) % self.tp == 0:
            count = int(sizes[0]) // int(seq)
            return 0, (tuple([int(seq)] * count) if count > 1 else None)
        return None

    def _scatter_output(self, node) -> None:
        """Sequence parallelism: a row-wise output or a vocabulary lookup (partial sums) is reduce-scattered over
        the sequence instead of all-reduced, and the activations after it are sequence shards."""
        found = self._sequence_dim(_val(node))
        if found is None:
            return
        dim, segments = found
        self.reduce_scatters[node] = (dim, self.groups_of(segments))
        self._place(node, dim, segments, kind="seq")

    def _scatter_features(self, node, x, dim: int) -> None:
        """A row-wise output whose sum is read only at this rank's piece of its features (``tp_learn``: through
        ops that keep each feature apart; x-transformers' output gate, ``sigmoid(to_output_gate(out))`` of the
        merged heads, multiplying each rank's heads): reduce-scattered over them instead of all-reduced and then
        read at the piece, half the bytes forward (its backward gathers the gradient, as the read did). In the
        segments of its input where it is as wide (heads tiled for grouped-query attention: each rank's heads are a
        piece of each tile, and so is its piece of the gate); one piece otherwise."""
        features = 1 if node.target in rules.CONVS else -1  # x's (a 1 x 1 convolution's channels)
        segments = self.segs.get(x) if _equal(_val(node).shape[dim], _val(x).shape[features]) else None
        groups = self.groups_of(segments)
        if groups:
            self.reduce_scatters[node] = (dim, groups)
            self._place(node, dim, segments)

    def _batched_matmul(self, node, operands=None) -> bool:
        """``q @ k.transpose(-1, -2)`` of eager attention, ``bmm`` of heads merged with the batch (Bloom's
        ``[batch * heads, seq, dim]``): operands sharded on the same batch dim (heads), with the same segments.
        Neither operand's matrix dims may be the sharded one (that would be a contraction or a cut of the rows).
        A whole operand as wide as that batch dim (a key repeated for grouped-query attention whose projection
        stays whole) is read at this rank's piece (``tp_scatter``; its gradient is gathered), one broadcast
        along it as it is (its gradient summed over tp)."""
        a, b = operands or node.args[:2]
        if self._kind_of([a, b]) != "tp":
            return False
        out = _val(node).dim()
        dims, segments = set(), set()
        for arg in (a, b):
            val = _val(arg)
            if arg in self.shard:
                d = self.shard[arg]
                if d >= val.dim() - 2:
                    return False
                dims.add(out - (val.dim() - d))
                segments.add(self.segs.get(arg))
        if len(dims) != 1 or len(segments) != 1:
            return False
        e, segs = next(iter(dims)), next(iter(segments))
        groups = self.groups_of(segs)
        reads, claims = [], []
        for arg in (a, b):
            if arg not in self.shard:
                val = _val(arg)
                at = e - (out - val.dim())
                if at < 0 or _equal(val.shape[at], 1):
                    reads.append((arg, None))
                elif _equal(val.shape[at], _val(node).shape[e]) and self._param(arg) is not None and not segs:
                    claims.append((arg, at))  # a weight per head (RecurrentGemma's block-diagonal gates): sharded
                elif _equal(val.shape[at], _val(node).shape[e]) and groups:
                    reads.append((arg, at))
                else:
                    return False
        for arg, at in claims:
            self._claim(node, arg, at)
        self._read_whole(node, reads, groups)
        self._place(node, e, segs, self._origin_of([a, b]))
        return True

    def _feeds_linear(self, node, depth: int = 4) -> bool:
        """``node``'s value reaches the input of a linear of a 2-D parameter through elementwise ops alone (a gated
        product on its way to a row-wise projection), not the residual stream (which meets a norm first)."""
        for user in node.users:
            form = self._linear_form(user)
            if form is not None and form[0] is node:
                return True
            if depth and (user.target in rules.UNARY or user.target in rules.BINARY) and self._feeds_linear(user,
                                                                                                     depth - 1):
                return True
        return False

    def _param_only(self, node) -> bool:
        """``node`` is computed from parameters alone (``-A_log.exp()``, a weight reshaped): whole on every rank
        whatever the inputs, so reading it at a piece costs nothing forward (its gradient pieces are gathered)."""
        if node in self._made_of_params:
            return self._made_of_params[node]
        found = False
        if isinstance(node, fx.Node) and node not in self.shard:
            if node.op == "placeholder":
                found = node.name in self.fqn_of
            elif node.target is aten.type_as.default:  # the second operand gives only its dtype (OLMo-core's
                found = self._param_only(node.args[0])  # norm: ``weight.type_as(x)``)
            elif node.target is aten.embedding.default:  # a table picked at indices the model computes
                found = self._param_only(node.args[0]) and self._computed_index(node.args[1])
            elif node.op == "call_function" and node.all_input_nodes:
                found = all(self._param_only(arg) for arg in node.all_input_nodes)
        self._made_of_params[node] = found
        return found

    def _computed_index(self, index) -> bool:
        """Indices an embedding picks a table's rows at that the model computes and every rank holds whole
        (positions, buckets of distances), not the batch's token ids (a placeholder: a vocabulary lookup), cast or
        viewed or not (x-transformers' ``token_emb(x.to(long))``: its ids were taken for computed indices, the
        embedding for a table every rank holds whole, and a key computed from it for no key of one head)."""
        if not (isinstance(index, fx.Node) and index not in self.shard and not _val(index).dtype.is_floating_point):
            return False
        while (index.op == "call_function" and (index.target in rules.CASTS or index.target in rules.VIEWS
                                                or index.target is torch.ops.tracepp.cp_shard.default)
               and isinstance(index.args[0], fx.Node)):  # (cp_shard: the ids of this cp rank's positions)
            index = index.args[0]
        return index.op != "placeholder"

    def _read_whole(self, node, reads, groups=1) -> None:
        """Whole operands of an op on pieces: (input, dim) read at this rank's piece of ``dim`` (``tp_scatter``:
        each rank takes its piece, the gradient pieces are gathered back), or (input, None) broadcast along the
        sharded dim and read as it is (a gradient it carries is summed over tp: ``tp_copy``)."""
        for arg, at in reads:
            if at is not None and groups == 1 and self._expanded_to_piece(node, arg, at):
                continue
            if at is not None:
                self.scatters.append((node, arg, at, groups))
                self._claimed.add((node, arg))
            elif self.needs_grad.get(arg):
                self.copies.append((node, arg))

    def _expanded_to_piece(self, node, arg, at: int) -> bool:
        """A whole operand that is an ``expand`` of a value of size 1 at ``at``, read by ``node`` alone (the rotary
        key DeepSeek's MLA shares among the heads, ``k_pe.expand(b, heads, s, d)``): expanded to this rank's piece,
        what it expands read through ``tp_copy`` (its gradient all-reduced: a head's worth), where cutting the piece
        from the whole expand would gather every head's gradient back."""
        if arg.target not in rules.EXPANDS or len(arg.users) != 1 or arg in self.shard:
            return False
        inner, out = _val(arg.args[0]), _val(arg)
        at_in = at - (out.dim() - inner.dim())
        if not (at_in < 0 or _equal(inner.shape[at_in], 1)) or not self._local_size(arg.args[1], at, out.shape[at]):
            return False
        self._place_on_piece(arg, at)
        self._claimed.add((node, arg))
        return True

    def _place_on_piece(self, node, at: int) -> None:
        """An expand (or a repeat) of a whole value's dim of 1 made on this rank's piece of ``at`` (the rewrite makes
        its size this rank's): what it expands is read as it is, each rank's piece giving its gradient a part
        (``tp_copy``)."""
        self._place(node, at)
        if self.needs_grad.get(node.args[0]):
            self.copies.append((node, node.args[0]))

    def _gather_along(self, node) -> bool:
        """``gather(x, dim, index)`` along a dim other than the sharded one (Inkling's relative-position bias per head,
        picked by distance): each output element reads its own row of x, so the output is sharded as x is; an index
        as wide as x's sharded dim (whole, an expanded table) is read at this rank's piece."""
        x, along, index = node.args[0], node.args[1], node.args[2]
        if (x not in self.shard or self.kind.get(x) == "seq" or x in self.segs
                or (node.args[3:] + tuple(node.kwargs.values())) not in ((), (False,))):  # sparse_grad=False
            return False
        d = self.shard[x]
        if along % _val(x).dim() == d:
            return False
        if index in self.shard:
            if self.shard[index] != d or self.segs.get(index) != self.segs.get(x):
                return False
        elif not _equal(_val(index).shape[d], _val(x).shape[d]) or self.needs_grad.get(index):
            return False
        else:
            self._read_whole(node, [(index, d)])
        self._carry(node, x)
        return True

    def _depthwise_conv(self, node) -> bool:
        """A depthwise convolution over sharded channels (``groups`` = channels: LFM2's short convolution, the causal
        conv1d of Mamba and gated delta-net mixers) mixes each channel with itself only, a grouped one (ZAYA's
        convolution per head: 6 groups of 16 channels) each group's channels with each other: where this rank's
        channels hold whole groups it runs on them, the whole weight and bias read at their rows (``tp_scatter``; the
        gradient rows gathered back), ``groups`` divided by tp."""
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
        held = [a for a in (weight, bias) if isinstance(a, fx.Node) and a in self.shard]  # sharded where made
        if (x not in self.shard or self.shard[x] != 1 or self.kind.get(x) == "seq" or not isinstance(groups, int)
                or any(self.shard[a] != 0 or self.kind.get(a) == "seq" for a in held)):
            return False
        if any(self.segs.get(a) != self.segs.get(x) for a in held):  # held in pieces of other segments (learned
            for a in held:                                           # before the channels were a projection's parts)
                self.repieces[a] = tuple(self.segs[x]) if self.segs.get(x) else None
            return False
        channels, wval = _val(x).shape[1], _val(weight)
        parts = self.groups_of(self.segs.get(x))
        if not parts and held:  # held in the same pieces: nothing of theirs is read
            parts = tuple(self.segs[x])
        if not parts and self._param_only(weight) and (not isinstance(bias, fx.Node) or self._param_only(bias)):
            parts = tuple(self.segs[x])  # q, k and v channels of a fused projection: each read at its piece
        per = int(channels) // groups if _ints([channels]) and groups and int(channels) % groups == 0 else 0
        pieces = [int(p) // self.tp for p in (self.segs.get(x) or [channels])] if per else []
        if groups == 1 and node.target is not aten.conv1d.default:
            return self._refuse(node, f"a {rules.op_name(node)} over sharded channels mixes them all, and no rule "
                                      f"sums it over tp: summed, its partial sums would be its whole output moved "
                                      f"(talking heads' scores, b h s^2 twice a layer), where computing its input "
                                      f"whole costs less (docs/tensor-parallel.md)")
        if not (per and int(wval.shape[0]) == int(channels) and int(wval.shape[1]) == per and groups % self.tp == 0
                and parts and all(p % per == 0 for p in pieces)):
            return self._refuse(node, f"a convolution over sharded channels whose groups a rank's channels do not "
                                      f"hold whole (groups {groups} of {channels} channels)")
        self._read_whole(node, [(a, 0) for a in (weight, bias) if isinstance(a, fx.Node) and a not in held], parts)
        self.conv_groups[node] = groups // self.tp
        self._place(node, 1, self.segs.get(x), self.origin.get(x, frozenset()))
        return True

    def _baddbmm(self, node) -> bool:
        """``baddbmm(input, b1, b2)`` (Bloom's ALiBi scores): a batched matmul over heads plus ``input``, which is
        elementwise on the output: sharded with it, read at its piece (the ALiBi table, whole, per head), or
        broadcast."""
        bias = node.args[0]
        if not self._batched_matmul(node, node.args[1:3]):
            return False
        e, segs = self.shard[node], self.segs.get(node)
        if bias in self.shard:
            if self.shard[bias] + _val(node).dim() - _val(bias).dim() != e or self.segs.get(bias) != segs:
                return self._unplace(node)
            return True
        val = _val(bias)
        at = e - (_val(node).dim() - val.dim())
        if at < 0 or _equal(val.shape[at], 1):
            self._read_whole(node, [(bias, None)])
        elif _equal(val.shape[at], _val(node).shape[e]) and self.groups_of(segs) and (
                not self.needs_grad.get(bias) or self._param_only(bias)):  # a table, or a bias per head
            self._read_whole(node, [(bias, at)], self.groups_of(segs))
        else:
            return self._unplace(node)
        return True

    def _einsum(self, node) -> bool:
        """``einsum(equation, operands)`` spelling attention (x-transformers' and einops' ``b h i d, b h j d ->
        b h i j``, then ``b h i j, b h j d -> b h i d``): the sharded operands sharded on one label (the heads)
        that the output keeps (a batch label, not one summed over), with the same segments: the output is sharded
        on it. A whole operand with that label (a key repeated to the query heads) is read at this rank's piece, a
        weight with it is sharded with it, one without it is read as it is."""
        labels, operands = rules.einsum_labels(node), list(node.args[1])
        if labels is None or self._kind_of(operands) != "tp":
            return False
        specs, output = labels
        sharded = [(spec, arg) for spec, arg in zip(specs, operands) if arg in self.shard]
        # the first operand sharded on a label the output keeps sets the placement (the queries, the scores); one
        # sharded otherwise (keys tiled to the query heads: their heads in segments) is gathered and read whole
        anchor = next((arg for spec, arg in sharded if output.count(spec[self.shard[arg]]) == 1), None)
        if anchor is None:
            return False  # summed over (a contraction of the sharded dim)
        label, segs = specs[operands.index(anchor)][self.shard[anchor]], self.segs.get(anchor)
        if any(spec.count(label) > 1 for spec in specs):
            return False  # a diagonal
        apart = [arg for spec, arg in sharded if spec[self.shard[arg]] != label or self.segs.get(arg) != segs]
        for arg in apart:
            if specs[operands.index(arg)][self.shard[arg]] == label:
                self._tiled_heads(anchor, arg)
        e, size = output.index(label), _val(node).shape[output.index(label)]
        reads, claims = [], []
        for spec, arg in zip(specs, operands):
            if arg in self.shard and arg not in apart:
                continue
            at = spec.find(label)
            val = _val(arg)
            if at < 0 or _equal(val.shape[at], 1):
                reads.append((arg, None))
            elif _equal(val.shape[at], size) and self._param(arg) is not None and not segs:
                claims.append((arg, at))
            elif _equal(val.shape[at], size) and self.groups_of(segs):
                reads.append((arg, at))
            else:
                return False
        for arg in apart:
            self._gather(node, arg)
        for arg, at in claims:
            self._claim(node, arg, at)
        self._read_whole(node, reads, self.groups_of(segs))
        self._place(node, e, segs, self._origin_of([a for a in operands if a in self.shard and a not in apart]))
        return True

    def _segmented_heads(self, node, qkv) -> bool:
        """Attention on queries, keys and values sharded on as many heads, in segments (DiffLlama's values: each
        half of the key/value heads a segment, tiled by ``repeat``; its output cut into halves of the heads): each
        head attends on its own, so where all three hold the same segments the output holds them too. Where they
        differ, each projection is asked for every cut point (in its features: a head ``rest`` wide), learned
        and walked again; until then the attention runs whole."""
        heads = {_val(t).shape[-3] for t in qkv}
        whole = [t for t in qkv[1:] if t not in self.shard]
        sharded = [t for t in qkv if t not in whole]
        if (len(heads) != 1 or not _ints(list(heads)) or node.kwargs.get("enable_gqa")
                or not self._broadcast_mask(node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask"))
                or any(self.shard.get(t) != _val(t).dim() - 3 or t in self.kind for t in sharded)):
            return False
        heads = int(next(iter(heads)))
        segs = {self.segs.get(t) for t in sharded}
        if len(segs) == 1 and (not whole or self.groups_of(self.segs.get(qkv[0]))):
            # a whole key or value (a projection kept whole: a segment of one key/value head, --tp 2) is read at
            # this rank's piece of each segment, the heads its queries read
            self._read_whole(node, [(t, _val(t).dim() - 3) for t in whole], self.groups_of(self.segs.get(qkv[0])))
            self._place(node, self.shard[qkv[0]], self.segs.get(qkv[0]), self._origin_of(sharded))
            return True
        points = set()
        for t in sharded:
            points |= set(rules.boundaries(self.segs.get(t) or [heads]))
        origins = [self.origin.get(t, frozenset()) for t in sharded]
        if all(o and all(self.out_features.get(f) and self.out_features[f] % heads == 0 for f in o) for o in origins):
            for fqn in frozenset().union(*origins):
                width = [_val(t).shape[-1] for t, o in zip(sharded, origins) if fqn in o]
                self._want_heads(node, fqn, points, self.out_features[fqn] // heads,
                                 int(width[0]) if _ints(width[:1]) else None)
        return False

    def _broadcast_mask(self, mask) -> bool:
        """None, or a whole attention mask without a gradient and with one head or none (read as it is)."""
        if not isinstance(mask, fx.Node):
            return mask is None
        val = _val(mask)
        return (mask not in self.shard and not self.needs_grad.get(mask)
                and (val.dim() < 3 or _equal(val.shape[val.dim() - 3], 1)))

    def _tiled_heads(self, a, b) -> None:
        """``a`` and ``b`` sharded on the same heads, one of them in equal segments, the other in none: keys and
        values tiled to the query heads by einops' ``repeat(t, 'b h n d -> b (r h) n d')`` (x-transformers: query
        head i reads key/value head i % h), their ``h`` heads sharded, so each of the ``r`` copies is a segment; or
        a fused projection's output beside its adapter's, joined from its q, k and v parts by ``cat`` in unequal
        segments (litgpt's LoRA on ``qkv``).
        The projections of the one without segments are asked for the other's (in their output features: each
        head's features are one ``rest`` wide), learned and walked again: rank r then holds the query heads that
        read its key/value heads (heads {i : i % h in its block}), and the attention runs on them."""
        if bool(self.segs.get(a)) == bool(self.segs.get(b)):
            return
        plain, tiled = (a, b) if self.segs.get(b) else (b, a)
        segments, heads = self.segs[tiled], _val(plain).shape[self.shard[plain]]
        if plain in self.part and _ints([heads] + list(segments)) and sum(int(s) for s in segments) == int(heads):
            self._want_in_part(plain, rules.boundaries(segments))  # the query part of a fused q, k, v (ring-attention:
            return  # split by head counts): its heads' points at the part's offset, in its own head width
        origin = self.origin.get(plain, frozenset())
        if (not origin or not _ints([heads] + list(segments))
                or sum(int(s) for s in segments) != int(heads)
                or any(not self.out_features.get(f) or self.out_features[f] % int(heads) for f in origin)):
            return
        for fqn in origin:
            rest = self.out_features[fqn] // int(heads)
            self.wants.setdefault(fqn, set()).update(p * rest for p in rules.boundaries(segments))

    def _unplace(self, node) -> bool:
        """Undo a placement made before a later check failed (the edits recorded for ``node`` dropped)."""
        self.shard.pop(node, None)
        self.segs.pop(node, None)
        self.origin.pop(node, None)
        self.copies = [(c, a) for c, a in self.copies if c is not node]
        self.scatters = [entry for entry in self.scatters if entry[0] is not node]
        self._claimed = {(c, a) for c, a in self._claimed if c is not node}
        return False

    def _attention(self, node) -> bool:
        """``scaled_dot_product_attention`` on heads sharded alike (dim -3). A whole key or value (its projection
        stays whole: fewer key/value heads than --tp, multi-query) is read at the heads this rank's queries
        need, as Megatron-Core replicates them: its piece when it has one head per query head or a multiple of
        --tp heads (``tp_scatter``), its group when --tp is a multiple of its head count and ``enable_gqa`` pairs
        groups of query heads with it (``tp_head_group``), as it is when it has one head (``tp_copy``)."""
        q, k, v = node.args[:3]
        if q not in self.shard or self.shard[q] != _val(q).dim() - 3 or q in self.kind:
            return False
        if q in self.segs or any(self.segs.get(t) for t in (k, v) if t in self.shard):
            return self._segmented_heads(node, (q, k, v))
        gqa = node.kwargs.get("enable_gqa", False)
        reads, groups, regathered = [], [], []
        heads = int(_val(q).shape[-3]) if _ints([_val(q).shape[-3]]) else None
        for t in (k, v):
            if t in self.shard:
                if self.shard[t] == _val(t).dim() - 3 and t not in self.segs and t not in self.kind:
                    continue
                if t in self.part or t in self.kind:
                    self._whole_part(t)  # a key/value part of a fused projection split inside its heads
                    return False
                # a key or value sharded on another dim (ZAYA's value: halves of each head from two projections,
                # each rank holding a piece of every head's features): every query head needs all of it, so it is
                # gathered here and read whole at this rank's heads below; the queries stay on their heads
                regathered.append(t)
            if heads is None or not _ints([_val(t).shape[-3]]):
                return False
            count = int(_val(t).shape[-3])
            if count == heads or (gqa and count % self.tp == 0 and heads % count == 0):
                reads.append((t, _val(t).dim() - 3))
            elif count == 1:  # one key/value head, broadcast to every query head (enable_gqa, or sdpa's
                reads.append((t, None))  # broadcasting of a dim of 1: Falcon-7B's multi-query attention)
            elif gqa and self.tp % count == 0 and heads % count == 0:
                groups.append((t, count))
            else:
                return self._refuse(node, f"{t.name} has {count} heads for {heads} query heads over --tp "
                                          f"{self.tp}: neither one per query head, a multiple of --tp, nor a "
                                          f"divisor of --tp")
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            if mask in self.shard:
                if self.shard[mask] + 4 - _val(mask).dim() != 1:
                    return False
            else:
                mval = _val(mask)
                at = 1 - (4 - mval.dim())
                if at >= 0 and mval.shape[at] != 1:
                    if not _equal(mval.shape[at], heads):
                        return False
                    # a mask per head (ALiBi, a relative bias, Doge's dynamic mask computed from the values):
                    # this rank's heads; where it carries a gradient, the pieces' gradients are gathered back
                    reads.append((mask, at))
                elif self.needs_grad.get(mask):
                    reads.append((mask, None))
        for t in regathered:
            self._refuse(node, f"reads {t.name} sharded on dim {self.shard[t]}, not on its heads: gathered, then "
                               f"read at this rank's heads")
            self._gather(node, t)
        self._read_whole(node, reads)
        for t, count in groups:
            self.head_groups.append((node, t, _val(t).dim() - 3, count))
            self._claimed.add((node, t))
        self._place(node, self.shard[q], None, self._origin_of([q] + [t for t in (k, v) if t not in regathered]))
        return True
