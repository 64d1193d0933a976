"""A small GPT-style language model as a tracepp model file, learning to spell two of Shakespeare's sonnets.

    tracepp split examples/gpt.py -o out --ranks 2 --schedule 1f1b --microbatches 4
    torchrun --nproc-per-node 2 out/run.py --steps 30 --optimizer adamw --lr 1e-2

Token embedding + learned positions, pre-norm transformer blocks (causal self-attention and an MLP), and an
LM head tied to the token embedding (as in GPT-2). ``split_points`` starts a new stage at ``blocks.2``;
``--split-points`` or ``--stages`` on the command line override it.

The tokens are the bytes of ``TEXT`` (so the vocabulary is 256): ``batch(step)`` cuts ``BATCH`` windows of
``SEQ + 1`` bytes at positions drawn from ``step``, the input is a window's first ``SEQ`` bytes and the target
the same window shifted by one. The loss starts at ln 256 = 5.55 (a uniform guess) and falls below 3.2 within
30 AdamW steps as the model learns which letters English uses.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D_MODEL, N_HEAD, N_LAYER, SEQ, BATCH = 256, 64, 4, 4, 32, 8


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_head, d_model // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=VOCAB, d_model=D_MODEL, n_head=N_HEAD, n_layer=N_LAYER, max_seq=SEQ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_seq, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: the pipeline keeps both copies identical
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            nn.init.normal_(block.mlp[2].weight, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def model():
    torch.manual_seed(0)
    return GPT()


TEXT = """\
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
Let me not to the marriage of true minds
Admit impediments. Love is not love
Which alters when it alteration finds,
Or bends with the remover to remove.
O no! it is an ever-fixed mark
That looks on tempests and is never shaken;
It is the star to every wand'ring bark,
Whose worth's unknown, although his height be taken.
Love's not Time's fool, though rosy lips and cheeks
Within his bending sickle's compass come;
Love alters not with his brief hours and weeks,
But bears it out even to the edge of doom.
If this be error and upon me prov'd,
I never writ, nor no man ever lov'd.
"""
TOKENS = torch.tensor(list(TEXT.encode()), dtype=torch.long)  # bytes: every id < VOCAB


def _tokens(step: int):
    """Step ``step``'s batch: ``BATCH`` windows of ``SEQ + 1`` bytes of TEXT, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, len(TOKENS) - SEQ, (BATCH,), generator=generator)
    data = torch.stack([TOKENS[start:start + SEQ + 1] for start in starts.tolist()])
    return data[:, :-1], data[:, 1:]


def example_inputs():
    return (_tokens(0)[0],)


def example_target():
    return _tokens(0)[1]


def batch(step):
    idx, target = _tokens(step)
    return (idx,), {}, target


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


split_points = ["blocks.2"]
