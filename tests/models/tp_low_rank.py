"""Low-rank query projections for tensor parallelism, as MLA-style attention writes them: a down-projection to a
narrow latent (32 -> 8 features) read directly by the up-projection into heads (Kimi Linear's forget gate has no
norm between them), the queries' up-projection column-wise on its heads, row-wise out. The down-projection is
column-wise with its latent all-gathered: every reader must read the gathered latent, the up-projection's input
copy included (it used to wrap the rank's piece: a shape error at the first step).
"""
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, lm_loss, model_of, token_batch

VOCAB, D, RANK, HEADS, BATCH, SEQ = 32, 32, 8, 4, 4, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_a, self.q_b = nn.Linear(D, RANK, bias=False), nn.Linear(RANK, D, bias=False)
        self.kv, self.o = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_b(self.q_a(x)).view(b, s, HEADS, -1).transpose(1, 2)
        k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(b, s, D))


model = model_of(VOCAB, D, Attention)
batch = token_batch(VOCAB, BATCH, SEQ, 1300)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
