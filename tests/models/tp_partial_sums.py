"""Two MLP branches summed before the residual add (a parallel-branch block, as Llama 4's MoE adds its shared expert
to its experts): their row-wise outputs are partial sums on each tp rank, and summing them (and halving the sum) is
linear in them, so one all-reduce after the sum serves both (``split/tp_partial.py``); their biases are added as
1/tp on every rank, their gradients summed. The second layer scales one
branch by a learned gain first: the product is linear in the partial sums too, and the gain's gradient is then a
part on each rank, summed when the step ends (``split/tp_grads.py``): one all-reduce (two before the gain's part was
summed: each branch all-reduced where it is made). The third sums three branches, one of them through a view and
also read by a ``tanh``: that branch is summed where it is made, so the view of it is whole, so neither sum is made
of partial sums alone and every branch is summed where it is made (three all-reduces, no wrong sum)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HIDDEN, LAYERS, BATCH, SEQ = 32, 16, 32, 3, 4, 8


class Branches(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        biased = how == "summed"  # GPT-J's, GPT-NeoX's parallel blocks: row-wise outputs with biases
        self.up1, self.down1 = nn.Linear(D, HIDDEN, bias=False), nn.Linear(HIDDEN, D, bias=biased)
        self.up2, self.down2 = nn.Linear(D, HIDDEN, bias=False), nn.Linear(HIDDEN, D, bias=biased)
        self.gain = nn.Parameter(torch.full((D,), 0.5)) if how == "gained" else None
        if how == "read whole":
            self.up3, self.down3 = nn.Linear(D, HIDDEN, bias=False), nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x):
        one = self.down1(F.gelu(self.up1(x)))
        if self.gain is not None:
            one = self.gain * one
        if self.how == "read whole":
            three = self.down3(F.relu(self.up3(x)))
            return x + (one.view(one.shape) + self.down2(F.silu(self.up2(x))) + three) + torch.tanh(one)
        return x + 0.5 * (one + self.down2(F.silu(self.up2(x))))


class BranchesLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Branches(how) for how in ("summed", "gained", "read whole")])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return BranchesLM()


def batch(step):
    g = torch.Generator().manual_seed(400 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {}, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
