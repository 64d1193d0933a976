"""lucidrains' product-key memory (``product_key_memory.PKM``, pip ``product_key_memory``) in place of the MLP of a
small pre-LayerNorm decoder of this file's own (token and learned position embeddings, causal multi-head attention of
4 heads of 16 through ``F.scaled_dot_product_attention(is_causal=True)``, a final LayerNorm and an untied head; only
the ``PKM`` layer is the library's, unchanged). Each ``PKM``: its own pre-LayerNorm, one ``to_queries`` linear
split into 2 halves x 4 heads of 16, a LayerNorm over each query, ``einsum`` scores against learned sub-keys
``[heads, 16 keys, 2, 16]``, ``topk`` 4 in each half, the 4 x 4 Cartesian sums and index products, a second
``topk``, ``gather``, softmax gates, and the 256 memory values read by ``nn.EmbeddingBag(mode="sum")`` with the
gates as ``per_sample_weights`` (``aten._embedding_bag``). dim 64, 2 layers, vocabulary 128.
"""
import torch
import torch.nn.functional as F
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from product_key_memory import PKM
from torch import nn

LIBRARY, VERSION = "product_key_memory", version("product_key_memory")
SOURCE = "product_key_memory/product_key_memory.py (PKM); the decoder around it is this file's"
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM, bias=False)
        self.proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).split(HEADS * HEAD_DIM, dim=-1)
        q, k, v = (z.view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.pkm = PKM(HIDDEN, heads=HEADS, num_keys=16, topk=4, dim_head=HEAD_DIM, pre_layernorm=True)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.pkm(x)


class PKMDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return PKMDecoder()


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
