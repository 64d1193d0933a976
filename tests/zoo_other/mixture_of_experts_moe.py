"""lucidrains' mixture-of-experts (pip ``mixture-of-experts``, ``mixture_of_experts.MoE``): the library ships an MoE
feed-forward, not a language model, so this file's own small decoder (token embedding, ``LAYERS`` pre-norm residual
blocks, a final norm and an untied head) stacks the library's ``MoE`` unchanged, as its README shows it, beside a
causal ``x_transformers`` ``Attention`` (4 query heads of 16, 2 key/value heads, x-transformers' ``RotaryEmbedding``;
``nn.RMSNorm`` pre-norms). The MoE: ``Top2Gating`` (a ``randn``-initialised ``[dim, experts]`` gating weight applied
by ``einsum``, softmax, top-1 twice, the second expert kept with probability min(1, gate / 0.2) drawn by
``uniform_`` in training: its default ``second_policy_train='random'``), per-sequence expert capacity (``cumsum``
along the sequence, ``safe_one_hot``), dispatch and combine by ``einsum``, and ``Experts``: 4 experts as 3-D weights
``[experts, dim, hidden]`` applied by ``einsum`` (ReLU, hidden 128). The model returns the logits; the auxiliary
balance loss is left out of the loss. dim 64, 2 layers, vocabulary 128.

``MOE_SECOND_POLICY`` selects the gating's other training policies (``all``, ``none``, ``threshold``: no random
numbers drawn); the default is the library's.
"""
import os

import torch
from mixture_of_experts import MoE
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)
from torch import nn
from x_transformers.x_transformers import Attention, RotaryEmbedding

LIBRARY, VERSION = "mixture-of-experts", version("mixture-of-experts")
SOURCE = "mixture_of_experts/mixture_of_experts.py (MoE, Top2Gating, Experts); " \
         "x_transformers/x_transformers.py (Attention, RotaryEmbedding); the decoder around them is this file's"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
EXPERTS = 4
SECOND_POLICY = os.environ.get("MOE_SECOND_POLICY", "random")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = nn.RMSNorm(HIDDEN)
        self.attn = Attention(HIDDEN, dim_head=HEAD_DIM, heads=HEADS, kv_heads=KV_HEADS, causal=True)
        self.moe_norm = nn.RMSNorm(HIDDEN)
        self.moe = MoE(dim=HIDDEN, num_experts=EXPERTS, hidden_dim=HIDDEN * 2, activation=nn.ReLU,
                       second_policy_train=SECOND_POLICY, second_policy_eval=SECOND_POLICY,
                       second_threshold_train=0.2, second_threshold_eval=0.2, capacity_factor_train=1.25,
                       capacity_factor_eval=2., loss_coef=1e-2)

    def forward(self, x, rotary_pos_emb):
        x = self.attn(self.attn_norm(x), rotary_pos_emb=rotary_pos_emb) + x
        out, _aux_loss = self.moe(self.moe_norm(x))
        return out + x


class MoEDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, HIDDEN)
        self.rotary = RotaryEmbedding(HEAD_DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(HIDDEN)
        self.to_logits = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        x = self.token_emb(ids)
        pos = self.rotary.forward_from_seq_len(ids.shape[1])
        for layer in self.layers:
            x = layer(x, pos)
        return self.to_logits(self.norm(x))


def model():
    torch.manual_seed(0)
    return MoEDecoder()


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
