"""lucidrains' CoLT5 conditional computation (pip ``CoLT5-attention``, ``colt5_attention``): the library ships
layers, not a language model, so this file's own small decoder (token embedding, ``LAYERS`` residual blocks, the
library's ``RMSNorm`` and an untied head) stacks the library's classes unchanged. Each block is
``ConditionalRoutedAutoregressiveAttention`` (a light branch: ``local_attention.LocalMHA``, causal windowed attention
of 4 heads of 16 over every token; a heavy branch: the sequence cut into windows of 4, each window's queries and the
earlier windows' keys/values picked by two ``CoordinateDescentRouter``s -- 20 unrolled coordinate-descent iterations
(``logsumexp``/``relu``), ``topk``, a straight-through score -- gathered by advanced indexing, attended by
``Attention`` (its ``to_kv`` weight rearranged per route and applied by ``einsum``, learned null key/values, rotary
positions gathered at the routed indices), scaled by the router scores and scattered back by index assignment
(``route_back``) onto a learned null token) plus ``ConditionalRoutedFeedForward`` (a light GELU feed-forward of
mult 0.5 on every token, a heavy one of mult 2 on the 4 top-k routed tokens, scattered back), each added to the
residual. dim 64, 2 layers, 4 heads of 16 in both branches, vocabulary 128, 8 tokens.

The feed-forward router picks its top-k over the whole sequence (the library's ``ConditionalRoutedFeedForward`` has no
causal form), so the heavy feed-forward's choice of tokens sees later tokens; the attention is causal.
"""
import torch
from colt5_attention import ConditionalRoutedAutoregressiveAttention, ConditionalRoutedFeedForward
from colt5_attention.transformer_block import RMSNorm
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from torch import nn

LIBRARY, VERSION = "CoLT5-attention", version("CoLT5-attention")
SOURCE = "colt5_attention/transformer_block.py (ConditionalRoutedAutoregressiveAttention, ConditionalRoutedFeedForward, " \
         "CoordinateDescentRouter, Attention, RMSNorm), colt5_attention/coor_descent.py, local_attention (LocalMHA); " \
         "the decoder around them is this file's"
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form
WINDOW = 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = ConditionalRoutedAutoregressiveAttention(
            HIDDEN, num_heavy_tokens_q=2, num_heavy_tokens_kv=2, light_dim_head=HEAD_DIM, light_heads=HEADS,
            light_window_size=WINDOW, heavy_window_size=WINDOW, heavy_dim_head=HEAD_DIM, heavy_heads=HEADS,
            rotary_emb=True)
        self.ff = ConditionalRoutedFeedForward(HIDDEN, num_heavy_tokens=4, light_ff_mult=0.5, heavy_ff_mult=2)

    def forward(self, x):
        x = self.attn(x) + x
        return self.ff(x) + x


class CoLT5Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = RMSNorm(HIDDEN)
        self.to_logits = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        x = self.token_emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.to_logits(self.norm(x))


def model():
    torch.manual_seed(0)
    return CoLT5Decoder()


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
