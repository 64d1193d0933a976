"""The tiny language model many files here wrap around the block they test: an embedding, two blocks, a head; a
batch of random token ids and targets per step; cross entropy over the vocabulary. A model file names its block,
its sizes and its batch seed::

    model = model_of(VOCAB, D, Mixer)
    batch = token_batch(VOCAB, BATCH, SEQ, seed=1500)
    example_inputs, example_target = examples_of(batch)
    loss_fn = lm_loss(VOCAB)
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class LM(nn.Module):
    def __init__(self, vocab, d, block, count=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([block() for _ in range(count)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ResidualMLP(nn.Module):
    """``x + down(gelu(up(norm(x))))``, ``d -> 4d -> d``, its two linears of the class ``linear`` (a quantized one)."""

    def __init__(self, d, linear=nn.Linear):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = linear(d, 4 * d), linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def mlp_of(d, linear=nn.Linear):
    """``block()``: a :class:`ResidualMLP` of width ``d`` whose linears are ``linear``."""
    return lambda: ResidualMLP(d, linear)


def model_of(vocab, d, block, count=2):
    """``model()``: the LM of ``count`` ``block()``s, seeded (the embedding made first, then the blocks, the head)."""
    def model():
        torch.manual_seed(0)
        return LM(vocab, d, block, count)
    return model


def token_batch(vocab, batch, seq, seed):
    """``batch(step)``: ``((ids,), {}, targets)``, each ``[batch, seq]`` of the vocabulary, from ``seed + step``."""
    def batch_of(step):
        g = torch.Generator().manual_seed(seed + step)
        return (torch.randint(0, vocab, (batch, seq), generator=g),), {}, torch.randint(0, vocab, (batch, seq),
                                                                                         generator=g)
    return batch_of


def examples_of(batch):
    """``(example_inputs, example_target)`` of step 0's batch."""
    return (lambda: batch(0)[0]), (lambda: batch(0)[2])


def lm_loss(vocab):
    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
    return loss_fn
