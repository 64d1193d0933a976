"""A tiny mixture-of-experts LM written the way torchtitan writes its MoE (``torchtitan/models/common/moe.py`` and
``token_dispatcher.py``, 0.3.0), with no third-party package:

* expert weights stored ``[experts, out, in]`` like one ``nn.Linear`` per expert (``w1_EFD``, ``w2_EDF``,
  ``w3_EFD``) and multiplied as ``torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1), offs=...)``,
  gate and up as two grouped matmuls, the output cast back with ``type_as``;
* the router's softmax scores and top-k (``TokenChoiceTopKRouter``), tokens per expert as the sum of a one-hot
  routing map (``scatter_``), their cumsum in int32 the offsets;
* the tokens reordered by a stable ``argsort`` of the expert ids (``LocalTokenDispatcher._local_reorder``), the
  scores applied to the expert outputs in fp32 and the rows added back to their tokens with ``scatter_add``;
* a shared expert (``FeedForward``: ``w2(silu(w1(x)) * w3(x))``) beside the routed ones, and a no-grad count of
  tokens per expert in a buffer, as ``MoE.forward`` keeps for load balancing.

4 experts, top 2, dim 32 (``torch._grouped_mm`` on CPU takes bf16 with strides a multiple of 16 bytes).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HIDDEN, EXPERTS, TOP_K, LAYERS, BATCH, SEQ = 64, 32, 32, 4, 2, 2, 4, 8


class GroupedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = EXPERTS
        self.w1_EFD = nn.Parameter(torch.randn(EXPERTS, HIDDEN, D) * 0.1)
        self.w2_EDF = nn.Parameter(torch.randn(EXPERTS, D, HIDDEN) * 0.1)
        self.w3_EFD = nn.Parameter(torch.randn(EXPERTS, HIDDEN, D) * 0.1)

    def forward(self, x_RD, num_tokens_per_expert_E):
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(self._grouped_mm(A=x_RD.bfloat16(), B_t=self.w1_EFD.bfloat16().transpose(-2, -1),
                                       offs=offsets_E))
        h_RF = h_RF * self._grouped_mm(A=x_RD.bfloat16(), B_t=self.w3_EFD.bfloat16().transpose(-2, -1),
                                       offs=offsets_E)
        return self._grouped_mm(A=h_RF, B_t=self.w2_EDF.bfloat16().transpose(-2, -1), offs=offsets_E).type_as(x_RD)

    def _grouped_mm(self, *, A, B_t, offs):
        return torch._grouped_mm(A, B_t, offs=offs)


class LocalTokenDispatcher:
    def __init__(self):
        self.top_k = TOP_K

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        token_indices_experts_sorted_N = torch.argsort(topk_expert_ids_TK.view(-1), stable=True)
        topk_scores_experts_sorted_N = topk_scores_TK.view(-1)[token_indices_experts_sorted_N]
        token_indices_experts_sorted_N = token_indices_experts_sorted_N // self.top_k
        routed_input_RD = x_TD[token_indices_experts_sorted_N]
        return routed_input_RD, num_local_tokens_per_expert_E, (token_indices_experts_sorted_N,
                                                                topk_scores_experts_sorted_N)

    def combine(self, routed_output_RD, metadata, x_TD):
        token_indices_experts_sorted_N, topk_scores_experts_sorted_N = metadata
        out_TD = torch.zeros_like(x_TD)
        routed_output_RD = (routed_output_RD.to(torch.float32)
                            * topk_scores_experts_sorted_N.reshape(-1, 1)).to(routed_output_RD.dtype)
        index = token_indices_experts_sorted_N.reshape(-1, 1).expand(-1, x_TD.shape[-1])
        return out_TD.scatter_add(dim=0, index=index, src=routed_output_RD)


class RoutedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner_experts = GroupedExperts()
        self.token_dispatcher = LocalTokenDispatcher()

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        B, L, D_ = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        x_TD = x_BLD.view(B * L, D_)
        routed_input_RD, counts_E, metadata = self.token_dispatcher.dispatch(
            x_TD, topk_scores_BLK.view(-1, K), topk_expert_ids_BLK.view(-1, K), num_local_tokens_per_expert_E)
        routed_output_RD = self.inner_experts(routed_input_RD, counts_E)
        return self.token_dispatcher.combine(routed_output_RD, metadata, x_TD).view(B, -1, D_)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, EXPERTS, bias=False)
        self.top_k = TOP_K

    def forward(self, x_BLD, expert_bias_E=None):
        scores_BLE = F.softmax(self.gate(x_BLD), dim=-1)
        scores_for_choice_BLE = scores_BLE if expert_bias_E is None else scores_BLE + expert_bias_E
        _, topk_expert_ids_BLK = torch.topk(scores_for_choice_BLE, k=self.top_k, dim=-1, sorted=False)
        topk_scores_BLK = scores_BLE.gather(dim=-1, index=topk_expert_ids_BLK)
        topk_scores_BLK = topk_scores_BLK / (topk_scores_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_scores_BLK, topk_expert_ids_BLK, scores_BLE


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, D, bias=False)
        self.w3 = nn.Linear(D, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.routed_experts = RoutedExperts()
        self.router = TokenChoiceTopKRouter()
        self.shared_experts = FeedForward()
        self.register_buffer("expert_bias_E", torch.zeros(EXPERTS), persistent=True)
        self.register_buffer("tokens_per_expert_E", torch.zeros(EXPERTS), persistent=False)

    def forward(self, x_BLD):
        topk_scores_BLK, topk_expert_ids_BLK, scores_BLE = self.router(x_BLD, self.expert_bias_E)
        routing_map_BLE = torch.zeros_like(scores_BLE, dtype=torch.bool).scatter_(-1, topk_expert_ids_BLK, True)
        num_local_tokens_per_expert_E = routing_map_BLE.sum(dim=(0, 1))
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(num_local_tokens_per_expert_E)
        out_BLD = self.routed_experts(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        return out_BLD + self.shared_experts(x_BLD)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.moe = MoE()

    def forward(self, x):
        return x + self.moe(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def model():
    torch.manual_seed(0)
    return Net()


def _data(step):
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def example_inputs():
    return (_data(0)[0],)


def example_target():
    return _data(0)[1]


def batch(step):
    tokens, target = _data(step)
    return (tokens,), {}, target


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


split_points = ["layers.1"]
