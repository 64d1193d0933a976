"""Boolean indexing gives a size no input shape determines; it crosses a pipe_split() boundary."""
import torch, torch.nn as nn
from tracepp import pipe_split
class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.a = nn.Linear(4, 4); self.b = nn.Linear(4, 4)
    def forward(self, x):
        h = self.a(x)
        picked = h[h[:, 0] > 0]
        pipe_split()
        return self.b(picked).sum(0, keepdim=True).expand(x.shape[0], 4)
def model():
    torch.manual_seed(0); return Net()
def example_inputs():
    return (torch.randn(4, 4),)
