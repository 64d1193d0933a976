"""A decoder as torchscale (and fairseq before it) writes one, with Magneto's sub-LayerNorm (torchscale's default,
``subln=True``; ``torchscale/component/multihead_attention.py`` and ``feedforward_network.py``):

* attention over ``batch * heads`` with ``torch.bmm``: q, k and v projected with biases, each viewed ``[b, s, heads,
  d]``, moved to ``[b * heads, s, d]``; an additive causal mask from ``torch.triu``; the output moved back
  time-major, ``attn.transpose(0, 1).reshape(s, b, heads * d).transpose(0, 1)``, then a **LayerNorm over every
  head's features** (``inner_attn_ln``) before ``out_proj``;
* a GELU FFN with a **LayerNorm over its hidden features** (``ffn_layernorm``) before ``fc2``;
* pre-norm LayerNorms on the residual stream, learned token embeddings, an untied head.

Under ``--tp 2`` the two sub-LayerNorms normalise over sharded dims (heads; the FFN's hidden). Gathered, they kept
every layer whole (a share of 0.0: ``out_proj`` and ``fc2`` then read whole inputs and their outputs, column-wise,
met the residual stream); written out as means over the shards (one all-reduce of ``[b, s, 1]`` each for the mean
and the variance, the norms' weights sharded with their inputs) the layer is Megatron's plus those statistics. At a
microbatch of one the time-major reshape of ``[s, b * heads, d]`` into ``[s, 1, heads * d]`` was read as a head of
one and kept attention whole; ``SUBLN=0`` leaves the sub-LayerNorms out (a plain pre-norm decoder).

``HEAD=bert`` puts BERT's prediction head on top (``BertPredictionHeadTransform``: dense, GELU, a LayerNorm over
the dense's features; then the vocabulary projection, tied to the embedding): written out, that norm would leave
the vocabulary projection row-wise against its vocabulary-parallel table (the tie replicates both), so its
gathered plan stays.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import loss_fn, sgd, token_batch  # noqa: F401  (the model file's loss_fn)

VOCAB, D, HEADS, FFN, LAYERS = 128, 64, 4, 128, 2  # a batch of 4 x 16 tokens (lib_style.token_batch)
SUBLN = os.environ.get("SUBLN", "1") == "1"
HEAD = os.environ.get("HEAD", "linear")


class MultiheadAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, D // HEADS
        self.scaling = self.head_dim ** -0.5
        self.k_proj, self.v_proj, self.q_proj = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.out_proj = nn.Linear(D, D)
        self.inner_attn_ln = nn.LayerNorm(D) if SUBLN else None

    def forward(self, query, attn_mask):
        bsz, tgt_len, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(query), self.v_proj(query)
        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        q = q.reshape(bsz * self.num_heads, tgt_len, self.head_dim)
        k = k.reshape(bsz * self.num_heads, tgt_len, self.head_dim)
        v = v.reshape(bsz * self.num_heads, tgt_len, self.head_dim)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        attn_weights = attn_weights + attn_mask.unsqueeze(0)
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).type_as(attn_weights)
        attn = torch.bmm(attn_weights, v)
        attn = attn.transpose(0, 1).reshape(tgt_len, bsz, embed_dim).transpose(0, 1)
        if self.inner_attn_ln is not None:
            attn = self.inner_attn_ln(attn)
        return self.out_proj(attn)


class FeedForwardNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, FFN), nn.Linear(FFN, D)
        self.ffn_layernorm = nn.LayerNorm(FFN) if SUBLN else None

    def forward(self, x):
        x = F.gelu(self.fc1(x).float()).type_as(x)
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        return self.fc2(x)


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.self_attn_layer_norm = MultiheadAttention(), nn.LayerNorm(D)
        self.ffn, self.final_layer_norm = FeedForwardNetwork(), nn.LayerNorm(D)

    def forward(self, x, mask):
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.ffn(self.final_layer_norm(x))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([DecoderLayer() for _ in range(LAYERS)])
        self.layer_norm = nn.LayerNorm(D)
        self.output_projection = nn.Linear(D, VOCAB, bias=False)
        if HEAD == "bert":
            self.transform = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D))
            self.output_projection.weight = self.embed_tokens.weight

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        seq = tokens.size(1)
        mask = torch.triu(torch.zeros([seq, seq], device=x.device).float().fill_(float("-inf")), 1)
        for layer in self.layers:
            x = layer(x, mask)
        x = self.layer_norm(x)
        if HEAD == "bert":
            x = self.transform(x)
        return self.output_projection(x)


def model():
    torch.manual_seed(0)
    m = Decoder()
    with torch.no_grad():  # norms away from their initial ones and zeros: a wrong shard of them would show
        for name, p in m.named_parameters():
            if "norm" in name or "_ln" in name:
                p.add_(0.1 * torch.randn_like(p))
    return m


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
