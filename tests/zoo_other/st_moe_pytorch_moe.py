"""lucidrains' ST-MoE (pip ``st-moe-pytorch``, ``st_moe_pytorch``): the library ships an MoE feed-forward, not a
language model, so this file's own small decoder (token embedding, ``LAYERS`` residual blocks, a final norm and an
untied head) stacks the library's classes unchanged, as its README shows them: each block is a causal
``x_transformers`` ``Attention`` (pre-norm with st-moe's ``RMSNorm``, 4 query heads of 16, 2 key/value heads,
x-transformers' ``RotaryEmbedding``) and then st-moe's ``SparseMoEBlock`` around its ``MoE`` (its own pre-RMSNorm,
``TopNGating``: softmax router, top-2 of 4 experts with the second routed with probability
min(1, gate / threshold 0.2) drawn by ``uniform_`` in training, per-sequence expert capacity (``cumsum`` along the
sequence, ``safe_one_hot``), dispatch and combine by ``einsum``; each ``Expert`` a GEGLU feed-forward with a
multiplicative bias) and a dense GEGLU ``Expert`` after it (``add_ff_after``, the README's). ``is_distributed=False``:
built inside a job whose process group is up, the library's ``Experts`` would otherwise all-gather the batch across
the ranks itself. The model returns the logits; the auxiliary losses (balance, router z) are left out of the loss.
dim 64, 2 layers, vocabulary 128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)
from st_moe_pytorch import MoE, SparseMoEBlock
from st_moe_pytorch.st_moe_pytorch import RMSNorm
from torch import nn
from x_transformers.x_transformers import Attention, RotaryEmbedding

LIBRARY, VERSION = "st-moe-pytorch", version("st-moe-pytorch")
SOURCE = "st_moe_pytorch/st_moe_pytorch.py (MoE, SparseMoEBlock, TopNGating, Experts, Expert, RMSNorm); " \
         "x_transformers/x_transformers.py (Attention, RotaryEmbedding); the decoder around them is this file's"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
EXPERTS = 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = RMSNorm(HIDDEN)
        self.attn = Attention(HIDDEN, dim_head=HEAD_DIM, heads=HEADS, kv_heads=KV_HEADS, causal=True)
        self.moe = SparseMoEBlock(
            MoE(dim=HIDDEN, num_experts=EXPERTS, expert_hidden_mult=3, gating_top_n=2, threshold_train=0.2,
                threshold_eval=0.2, capacity_factor_train=1.25, capacity_factor_eval=2., balance_loss_coef=1e-2,
                router_z_loss_coef=1e-3, is_distributed=False),
            add_ff_before=False, add_ff_after=True)

    def forward(self, x, rotary_pos_emb):
        x = self.attn(self.attn_norm(x), rotary_pos_emb=rotary_pos_emb) + x
        return self.moe(x).outputs


class STMoEDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, HIDDEN)
        self.rotary = RotaryEmbedding(HEAD_DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = RMSNorm(HIDDEN)
        self.to_logits = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        x = self.token_emb(ids)
        pos = self.rotary.forward_from_seq_len(ids.shape[1])
        for layer in self.layers:
            x = layer(x, pos)
        return self.to_logits(self.norm(x))


def model():
    torch.manual_seed(0)
    return STMoEDecoder()


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
