"""Rotary positions as torchtitan's Llama 3 applies them (``models/llama3/model.py`` and ``rope.py``): a complex
table ``freqs_cis = torch.polar(ones, outer(t, freqs))`` registered as a buffer with ``persistent=False``, sliced
``[0:seqlen]`` and viewed as ``[1, seqlen, 1, head_dim // 2]``; the queries and keys viewed as complex pairs
(``view_as_complex``), multiplied by it, viewed back (``view_as_real``) and flattened. Otherwise torchtitan's
Llama 3: ``wq``, ``wk``, ``wv``, ``wo``, ``repeat_kv``, ``scaled_dot_product_attention`` with ``is_causal``,
``nn.RMSNorm``, a SwiGLU ``feed_forward``; 2 layers, hidden 64, 4 query heads and 2 key/value heads of 16, 16 tokens.

``--cp 2`` must carry the sequence shard through the complex views, which regroup the last dim only, and read the
complex table at this rank's positions as a real rotary table is read (it was refused: "view_as_complex ... mixes
the positions of the sequence").
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, FFN, HEAD_DIM, HEADS, SEQ, VOCAB, loss_fn, sgd, token_batch

KV_HEADS = 2


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    return freqs_cis.view(1, seqlen, 1, x.shape[-1])


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_rep = HEADS // KV_HEADS
        self.wq = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(D, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(D, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, HEAD_DIM)
        xk = xk.view(bs, seqlen, -1, HEAD_DIM)
        xv = xv.view(bs, seqlen, -1, HEAD_DIM)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, FFN, bias=False)
        self.w2 = nn.Linear(FFN, D, bias=False)
        self.w3 = nn.Linear(D, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(D, eps=1e-5), nn.RMSNorm(D, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, n_layers=2, max_seq_len=2 * SEQ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.register_buffer("freqs_cis", precompute_freqs_cis(HEAD_DIM, max_seq_len), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(n_layers)})
        self.norm = nn.RMSNorm(D, eps=1e-5)
        self.output = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def model():
    torch.manual_seed(0)
    return Transformer()


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
