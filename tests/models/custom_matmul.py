"""A model whose forward calls a custom op (``tracepp_test::scaled_matmul``) that tracepp has no FLOP formula for
and that torch's counter does not see into: the split must name it in one warning and count everything else.
``FRAGILE["fail"] = True`` makes the op's fake implementation raise, as an op that cannot be re-run on fake or
meta tensors does (tests/test_flops.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

FRAGILE = {"fail": False}


@torch.library.custom_op("tracepp_test::scaled_matmul", mutates_args=())
def scaled_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x @ weight.t()) * 0.5


@scaled_matmul.register_fake
def _(x, weight):
    if FRAGILE["fail"]:
        raise RuntimeError("this op cannot run on fake tensors")
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    return (grad * 0.5) @ weight, ((grad * 0.5).reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


scaled_matmul.register_autograd(_backward, setup_context=_setup)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.w = nn.Parameter(torch.randn(32, 32) / 6)
        self.b = nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(scaled_matmul(torch.relu(self.a(x)), self.w)))


def model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(8, 16),)


def example_target():
    return torch.randn(8, 4)


def loss_fn(out, target):
    return F.mse_loss(out, target)


split_points = ["b"]
