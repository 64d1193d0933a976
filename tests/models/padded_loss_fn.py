"""Issue 57: a language model whose ``loss_fn`` is the mean cross-entropy over the tokens not ignored, labels
padded with -100 (``ignore_index``'s default: Hugging Face's, torchtune's and litgpt's padding), unevenly: the first
sample of each batch is a short prompt padded to the batch's length, the others full. The pipeline weighs each
microbatch's loss by its share of the batch's counted tokens (``split/token_mean.py``), as eager's one mean does.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, BATCH, SEQ = 32, 16, 4, 8


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, 2:] = -100  # a short first sample, padded
    labels[1, 6:] = -100
    return (ids,), {}, labels


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
