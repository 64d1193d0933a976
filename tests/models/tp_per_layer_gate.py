"""A decoder with Gemma 4's per-layer input gate, at real-size proportions: after the attention and a wide MLP, each
layer narrows the residual stream (``per_layer_input_gate``, 64 -> 4), multiplies it by that layer's slice of a
per-layer embedding of the tokens, and widens it back (``per_layer_projection``, 4 -> 64) into the residual stream.
The gate's two linears hold under 1% of a layer's parameters. As in Gemma 4, the layers' attention differs: the
sliding-window kind (layer 0 here) has heads narrower in all than the hidden size (4 x 8 under 64: its ``q_proj``
narrows and ``o_proj`` widens, the shapes of a low-rank pair), the global kind (layer 1) 4 x 16.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, FF, RANK, LAYERS, BATCH, SEQ = 64, 64, 4, 640, 4, 2, 4, 8


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Layer(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(D), RMSNorm(D)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, HEADS * head_dim, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(HEADS * head_dim, D, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.down_proj = nn.Linear(FF, D, bias=False)
        self.per_layer_input_gate = nn.Linear(D, RANK, bias=False)
        self.per_layer_projection = nn.Linear(RANK, D, bias=False)
        self.post_per_layer_input_norm = RMSNorm(D)

    def forward(self, x, per_layer_input):
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(b, s, HEADS, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        h = self.post_attention_layernorm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
        return x + self.post_per_layer_input_norm(self.per_layer_projection(gate))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.embed_tokens_per_layer = nn.Embedding(VOCAB, LAYERS * RANK)
        self.layers = nn.ModuleList([Layer(8), Layer(16)])  # a sliding-window layer, a global one
        self.norm = RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        per_layer = self.embed_tokens_per_layer(input_ids).view(*input_ids.shape, LAYERS, RANK)
        for index, layer in enumerate(self.layers):
            x = layer(x, per_layer[:, :, index, :])
        return self.lm_head(self.norm(x))


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(1800 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {}, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
