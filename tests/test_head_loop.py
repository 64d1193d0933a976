"""split/tp_head_loop.py on exported graphs: which loops over a dim's indices are loops over heads (each head's ops
the same ops on its own slices, joined in order), and which are not."""
import torch
import torch.nn.functional as F

from tracepp.split import tp_head_loop

HEADS = 4


def _graph(fn, *args, dynamic_batch=False):
    class M(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    shapes = None
    if dynamic_batch:
        batch = torch.export.Dim("batch", min=2, max=64)
        shapes = (tuple({0: batch} for _ in args),)  # (the one argument: xs)
    return torch.export.export(M(), args, dynamic_shapes=shapes).graph


def _one(graph):
    loops = tp_head_loop.find(graph)
    assert len(loops) <= 1, loops
    return next(iter(loops.values()), None)


def test_attention_head_by_head_stacked_is_a_loop_over_heads():
    q, k, v = (torch.randn(2, HEADS, 8, 16) for _ in range(3))

    def heads(q, k, v):
        return torch.stack([F.scaled_dot_product_attention(q[:, h], k[:, h], v[:, h]) for h in range(HEADS)], dim=1)

    loop = _one(_graph(heads, q, k, v))
    assert loop is not None and loop.heads == HEADS
    assert sorted(value.name for value in loop.taken) == ["xs_0", "xs_1", "xs_2"]
    assert list(loop.joins.values()) == [1]  # the stack's dim: where the heads are
    assert len({len(chain) for chain in loop.chains}) == 1


def test_heads_joined_by_a_cat_of_a_symbolic_batch_are_a_loop():
    # JetMoE's graph: pieces joined along a symbolic dim (comparing their sizes in a set raised "unhashable type:
    # non-nested SymInt")
    x = torch.randn(4, HEADS, 8)

    def heads(x):
        return torch.cat([torch.tanh(x[:, h]) for h in range(HEADS)], dim=0)

    loop = _one(_graph(heads, x, dynamic_batch=True))
    assert loop is not None and list(loop.joins.values()) == [0]


def test_a_per_head_table_read_by_each_head_is_taken_with_it():
    # Zamba's A[head_idx], D[head_idx]: a value every head's ops select their own row of, beside the sharded one
    x, table = torch.randn(2, HEADS, 8), torch.randn(HEADS, 8)

    def heads(x, table):
        return torch.stack([x[:, h] * table[h].exp() for h in range(HEADS)], dim=1)

    loop = _one(_graph(heads, x, table))
    assert loop is not None and {value.name: dim for value, dim in loop.taken.items()} == {"xs_0": 1, "xs_1": 0}


def test_heads_whose_ops_differ_are_no_loop():
    # a number per head (a python constant: ALiBi's slope written out) makes each head's ops other ops: a rank
    # running its own heads with the first heads' ops would compute them wrong
    x = torch.randn(2, HEADS, 8)

    def heads(x):
        return torch.stack([x[:, h] * (h + 1) for h in range(HEADS)], dim=1)

    assert _one(_graph(heads, x)) is None


def test_a_recurrence_over_the_indices_is_no_loop_over_heads():
    # a scan over time: step t reads step t - 1's state (two indices' values meet outside a join)
    x = torch.randn(2, HEADS, 8)

    def scan(x):
        state, out = torch.zeros(2, 8), []
        for t in range(HEADS):
            state = state * 0.5 + x[:, t]
            out.append(state)
        return torch.stack(out, dim=1)

    assert _one(_graph(scan, x)) is None


def test_heads_read_together_outside_the_join_are_no_loop():
    x = torch.randn(2, HEADS, 8)

    def heads(x):
        outs = [torch.tanh(x[:, h]) for h in range(HEADS)]
        return torch.stack(outs, dim=1), outs[0] + outs[1]

    assert _one(_graph(heads, x)) is None
