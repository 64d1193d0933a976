"""Issue 57: a model that computes its own loss over padded sequences, as PaLM-rlhf-pytorch's ``PaLM(seq,
return_loss=True)`` does (palm.py:516): the token ids and the labels cut from one sequence of L + 1 tokens inside
``forward`` (``seq[:, :-1]``, ``seq[:, 1:]``), ``F.cross_entropy(..., ignore_index=0)`` with 0 the pad id. The
mean is over the batch's tokens that are not padding, and the batches pad unevenly: the first two sequences of
each batch are half padding, so of 2 microbatches the first holds fewer counted tokens. Weighing each microbatch's
mean by its share of the samples moved every parameter by up to 2e-2 from eager, silently.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, BATCH, SEQ, PAD = 32, 16, 4, 8, 0


class ShiftLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, seq):
        x, labels = seq[:, :-1], seq[:, 1:]
        h = self.embed(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return F.cross_entropy(self.head(h).transpose(1, 2), labels, ignore_index=PAD)


def model():
    torch.manual_seed(0)
    return ShiftLM()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    seq = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=g)
    seq[:2, 3 + step % 2:] = PAD  # the first two sequences 3 or 4 tokens long, padded
    return (seq,), {}, seq


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(output, target):
    return output


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
