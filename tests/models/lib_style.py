"""Decoder pieces written the way libraries outside transformers write them (issue 57's four failure classes), for
the model files ``tp_normalize_rmsnorm.py``, ``tp_gemma_mqa_fused.py`` and ``tp_fused_qkv_groups.py``:

* ``NormalizeRMSNorm``: x-transformers' RMSNorm (``x_transformers.py``, ``RMSNorm``; lucidrains' repos write it
  alike): ``F.normalize(x, dim=-1) * sqrt(dim) * g``, the mean of squares never spelled out;
* ``GroupedFusedAttention``: lit-gpt's fused attention (``lit_gpt/model.py``, ``CausalSelfAttention``, before
  litgpt 0.5 split q, k and v apart; Megatron-Core and torchtitan lay theirs out alike): one ``attn`` projection
  whose output is viewed as ``[b, s, groups, heads_per_group + 2, head_dim]``, each key/value group's query heads,
  then its key, then its value; the key and value expanded to the group's query heads;
* ``GeGLU`` / ``SwiGLU``: lit-gpt's ``GemmaMLP`` / ``LLaMAMLP`` (``fc_1``, ``fc_2``, ``proj``).

Plain PyTorch; tiny sizes (hidden 64, 4 query heads of 16, a vocabulary of 128, a batch of 4 x 16 tokens).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, HEAD_DIM, FFN, BATCH, SEQ = 128, 64, 4, 16, 128, 4, 16


class NormalizeRMSNorm(nn.Module):
    """x-transformers' RMSNorm: ``F.normalize`` (an L2 norm, clamped at eps) times sqrt(dim) is x / rms(x)."""

    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.g


class LinalgNormRMSNorm(NormalizeRMSNorm):
    """The same norm as users write it with ``torch.linalg.norm`` (exported as ``aten.linalg_norm``, not the
    ``linalg_vector_norm`` of ``F.normalize``)."""

    def forward(self, x):
        return x / torch.linalg.norm(x, dim=-1, keepdim=True).clamp_min(1e-12) * self.scale * self.g


class RMSNorm(nn.Module):
    """lit-gpt's RMSNorm (``add_unit_offset`` as Gemma's): computed in fp32, the weight cast to fp32 too, the result
    cast back to the input's dtype."""

    def __init__(self, size, dim=-1, eps=1e-6, add_unit_offset=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.dim, self.add_unit_offset = eps, dim, add_unit_offset

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        weight = (1 + self.weight) if self.add_unit_offset else self.weight
        return (x_normed * weight.float()).to(dtype=dtype)


def rope_cache(seq, n_elem=HEAD_DIM, base=10000.0):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2).float() / n_elem))
    idx_theta = torch.outer(torch.arange(seq).float(), theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x, cos, sin):
    head_size = x.size(-1)
    x1, x2 = x[..., : head_size // 2], x[..., head_size // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos) + (rotated * sin)


class GroupedFusedAttention(nn.Module):
    """lit-gpt's CausalSelfAttention: ``n_query_groups`` key/value groups in one fused projection. ``layout="groups"``
    (lit-gpt before 0.5, whose weight is ``attn``; Megatron-Core and torchtitan lay theirs out alike): the output
    viewed as ``[b, s, groups, heads_per_group + 2, head_dim]``, each group's query heads, its key, its value, the key
    and value expanded to the group's query heads. ``layout="parts"`` (litgpt 0.5, ``qkv``): all query heads, then
    the keys, then the values, split apart; rotary on the first ``rope_n_elem`` features of each head and the rest
    joined back with ``cat`` (empty when rotary covers the head); keys and values ``repeat_interleave``d."""

    def __init__(self, groups, layout="groups", rope_n_elem=HEAD_DIM):
        super().__init__()
        self.groups, self.layout, self.rope_n_elem = groups, layout, rope_n_elem
        shape = (HEADS + 2 * groups) * HEAD_DIM
        self.attn = nn.Linear(D, shape, bias=False)
        self.proj = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        qkv = self.attn(x)
        q_per_kv = HEADS // self.groups
        if self.layout == "groups":
            total_qkv = q_per_kv + 2  # each group has 1+ queries, 1 key, and 1 value
            qkv = qkv.view(B, T, self.groups, total_qkv, HEAD_DIM)
            qkv = qkv.permute(0, 2, 3, 1, 4)  # (B, n_query_groups, total_qkv, T, hs)
            q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
            if self.groups != HEADS:  # repeat k and v for grouped- and multi-query attention
                k = k.expand(B, self.groups, q_per_kv, T, HEAD_DIM)
                v = v.expand(B, self.groups, q_per_kv, T, HEAD_DIM)
            q = q.reshape(B, -1, T, HEAD_DIM)  # (B, nh_q, T, hs)
            k = k.reshape(B, -1, T, HEAD_DIM)  # (B, nh_k, T, hs)
            v = v.reshape(B, -1, T, HEAD_DIM)  # (B, nh_v, T, hs)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            query_size, key_size = HEADS * HEAD_DIM, self.groups * HEAD_DIM
            q, k, v = qkv.split((query_size, key_size, key_size), dim=-1)
            q = q.view(B, T, HEADS, HEAD_DIM).transpose(1, 2)  # (B, nh_q, T, hs)
            k = k.view(B, T, self.groups, HEAD_DIM).transpose(1, 2)  # (B, nh_k, T, hs)
            v = v.view(B, T, self.groups, HEAD_DIM).transpose(1, 2)  # (B, nh_v, T, hs)
            n = self.rope_n_elem
            q = torch.cat((apply_rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
            k = torch.cat((apply_rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)
            if self.groups != HEADS:
                k = k.repeat_interleave(q_per_kv, dim=1)
                v = v.repeat_interleave(q_per_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(HEAD_DIM))
        y = y.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM)
        return self.proj(y)


class SeparateAttention(nn.Module):
    """x-transformers' Attention and Attend, reduced: ``to_q``, ``to_k``, ``to_v``, ``to_out``; grouped-query key/value
    heads tiled to the query heads (einops' ``'b kvh n d -> b (r kvh) n d'``: query head h reads key/value head
    h mod kv_heads), the scores and the output as ``einsum`` (``attend.py``: its default path), or with ``flash``
    ``F.scaled_dot_product_attention`` on the tiled heads (its ``attn_flash=True`` path)."""

    def __init__(self, kv_heads, flash=False):
        super().__init__()
        self.kv_heads, self.flash = kv_heads, flash
        self.to_q = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.to_k = nn.Linear(D, kv_heads * HEAD_DIM, bias=False)
        self.to_v = nn.Linear(D, kv_heads * HEAD_DIM, bias=False)
        self.to_out = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        return self.to_out(self.heads(x, cos, sin).transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))

    def heads(self, x, cos, sin):
        """Each head's output, ``[b, heads, n, d]``."""
        q, k, v = self.tiled(x, lambda t: apply_rope(t, cos, sin))
        if self.flash:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return einsum_attention(q, k, v)


    def tiled(self, x, rotate=None):
        """``q, k, v`` ``[b, heads, n, d]``: the key/value heads tiled to the query heads (``'b kvh n d -> b (r kvh) n
        d'``), ``rotate`` applied to the queries and keys first."""
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.to_k(x).view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = self.to_v(x).view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2)
        if rotate is not None:
            q, k = rotate(q), rotate(k)
        r = HEADS // self.kv_heads
        return q, k.repeat(1, r, 1, 1), v.repeat(1, r, 1, 1)


def einsum_attention(q, k, v):
    """Causal attention over ``[b, heads, s, d]`` as x-transformers' ``Attend`` writes it by default: ``einsum`` scores,
    a causal mask, softmax, ``einsum`` with the values."""
    T = q.shape[2]
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * q.shape[-1] ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
    return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


def rotate_half_interleaved(x):
    """x-transformers' ``rotate_half``: the head dim read as pairs (``'... (d r) -> ... d r'``), each pair turned by
    ``stack((-x2, x1), dim=-1)`` and flattened back."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_interleaved(t, freqs):
    """x-transformers' ``apply_rotary_pos_emb``: partial rotary (the first ``freqs.shape[-1]`` features of each head),
    the rest joined back with ``cat``."""
    rot = freqs.shape[-1]
    t, rest = t[..., :rot], t[..., rot:]
    return torch.cat((t * freqs.cos() + rotate_half_interleaved(t) * freqs.sin(), rest), dim=-1)


class TiledAttention(SeparateAttention):
    """x-transformers' Attention and Attend as export records them: the key/value heads tiled to the query heads by
    einops' ``repeat(t, 'b kvh n d -> b (r kvh) n d')``, which is ``unsqueeze(1)``, ``expand`` over ``r`` and a
    ``reshape`` merging ``(r kvh)`` (query head i reads key/value head i % kvh), interleaved partial rotary on the
    heads (``rotate_half``'s ``stack``), the scores and the output as ``einsum``."""

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.to_k(x).view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = self.to_v(x).view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2)
        t = torch.arange(T, dtype=torch.float32)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM // 2, 2).float() / (HEAD_DIM // 2)))
        freqs = torch.stack((torch.outer(t, inv_freq),) * 2, dim=-1).flatten(-2)  # [T, HEAD_DIM // 2]
        q, k = apply_rotary_interleaved(q, freqs), apply_rotary_interleaved(k, freqs)
        r = HEADS // self.kv_heads
        k, v = (t.unsqueeze(1).expand(-1, r, -1, -1, -1).reshape(B, HEADS, T, HEAD_DIM) for t in (k, v))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HEAD_DIM ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


class SwiGLU(nn.Module):
    """lit-gpt's LLaMAMLP."""

    def __init__(self):
        super().__init__()
        self.fc_1 = nn.Linear(D, FFN, bias=False)
        self.fc_2 = nn.Linear(D, FFN, bias=False)
        self.proj = nn.Linear(FFN, D, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class GeGLU(SwiGLU):
    """lit-gpt's GemmaMLP (tanh-approximated GELU)."""

    def forward(self, x):
        return self.proj(F.gelu(self.fc_1(x), approximate="tanh") * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, norm, attention, mlp):
        super().__init__()
        self.norm_1, self.attn, self.norm_2, self.mlp = norm(), attention(), norm(), mlp()

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class Decoder(nn.Module):
    """lit-gpt's GPT: ``transformer.wte``, ``transformer.h``, ``transformer.ln_f``, ``lm_head``."""

    def __init__(self, layers, norm, attention, mlp, embed_scale=False):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(VOCAB, D),
            "h": nn.ModuleList([Block(norm, attention, mlp) for _ in range(layers)]),
            "ln_f": norm()})
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.embed_scale = embed_scale

    def forward(self, idx):
        cos, sin = rope_cache(idx.shape[1])
        x = self.transformer.wte(idx)
        if self.embed_scale:  # Gemma scales the embeddings by sqrt(hidden)
            x = x * torch.tensor(D ** 0.5, dtype=x.dtype)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))


def token_batch(step):
    g = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (tokens[:, :-1],), {}, tokens[:, 1:]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def alibi_slopes(heads):
    """ALiBi's per-head slopes (Press et al.; BLOOM's ``build_alibi_tensor`` for a power-of-two head count)."""
    start = 2 ** (-(2 ** -(math.log2(heads) - 3)))
    return torch.tensor([start ** (i + 1) for i in range(heads)])


class AlibiBaddbmmAttention(nn.Module):
    """Attention spelled as BLOOM and its descendants spell it: one fused ``query_key_value`` projection, heads merged
    with the batch, the scores as ``baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(d))`` where ``alibi`` is each head's
    slope times the key position ``[b * heads, 1, keys]``, a causal mask, softmax, ``bmm`` with the values. With
    ``relative``, the bias as the ALiBi paper writes it, each head's slope times the distance ``key - query``, one
    value per query and key ``[b * heads, queries, keys]``."""

    def __init__(self, kv_heads=HEADS, relative=False):
        super().__init__()
        self.relative = relative
        self.query_key_value = nn.Linear(D, 3 * HEADS * HEAD_DIM)
        self.dense = nn.Linear(HEADS * HEAD_DIM, D)
        self.register_buffer("slopes", alibi_slopes(HEADS), persistent=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        fused = self.query_key_value(x).view(B, T, HEADS, 3, HEAD_DIM)
        q, k, v = fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
        q = q.transpose(1, 2).reshape(B * HEADS, T, HEAD_DIM)
        k = k.permute(0, 2, 3, 1).reshape(B * HEADS, HEAD_DIM, T)
        v = v.transpose(1, 2).reshape(B * HEADS, T, HEAD_DIM)
        positions = torch.arange(T, device=x.device)
        if self.relative:
            distance = (positions[None, :] - positions[:, None]).to(self.slopes.dtype)
            alibi = (self.slopes[:, None, None] * distance)[None].expand(B, HEADS, T, T).reshape(B * HEADS, T, T)
        else:
            alibi = (self.slopes[:, None] * positions[None, :].to(self.slopes.dtype))[None].expand(B, HEADS, T)
            alibi = alibi.reshape(B * HEADS, 1, T)
        scores = alibi.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=1.0 / math.sqrt(HEAD_DIM))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.view(B, HEADS, T, T).masked_fill(causal, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1).view(B * HEADS, T, T)
        context = torch.bmm(probs, v).view(B, HEADS, T, HEAD_DIM).transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM)
        return self.dense(context)


class LayerNormMLP(nn.Module):
    """BLOOM's MLP: ``dense_h_to_4h``, GELU, ``dense_4h_to_h``."""

    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(D, FFN)
        self.dense_4h_to_h = nn.Linear(FFN, D)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class OLMoRMSNorm(nn.Module):
    """OLMo-core's RMSNorm (``olmo_core/nn/layer_norm.py``, ``full_precision``): the whole norm under
    ``torch.autocast(enabled=False)``, in fp32, the weight ``type_as`` the input, the result cast back."""

    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        with torch.autocast(enabled=False, device_type=x.device.type):
            og_dtype = x.dtype
            x = x.float()
            variance = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(variance + self.eps)
            x = self.weight.type_as(x) * x
            return x.to(og_dtype)


class OLMoRotaryEmbedding(nn.Module):
    """OLMo-core's RotaryEmbedding (``olmo_core/nn/rope.py``, ``full_precision``, no cache): ``forward`` applies it
    under ``torch.autocast(enabled=False)``, and the sin/cos table it reads there is computed by
    ``_get_rotary_embedding`` under an ``autocast(enabled=False)`` of its own: one region inside another."""

    def __init__(self, head_size=HEAD_DIM, theta=500_000):
        super().__init__()
        self.dim, self.theta = head_size, theta

    def _get_rotary_embedding(self, seq_len, device):
        with torch.autocast(device.type, enabled=False):
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float) / self.dim))
            seq = torch.arange(seq_len, device=device, dtype=torch.float)
            freqs = torch.einsum("i , j -> i j", seq, inv_freq)
            positions = torch.cat((freqs, freqs), dim=-1)
            pos_sin, pos_cos = positions.sin(), positions.cos()
        return pos_sin, pos_cos

    def _rotate_half(self, x):
        B, nh, T, hs = x.size()
        x1, x2 = x.view(B, nh, T, 2, hs // 2).unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def _apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return ((t * pos_cos) + (self._rotate_half(t) * pos_sin)).to(t.dtype)

    def forward(self, q, k):
        q_, k_ = q.float(), k.float()
        with torch.autocast(q.device.type, enabled=False):
            pos_sin, pos_cos = self._get_rotary_embedding(k_.size(2), q_.device)
            pos_sin, pos_cos = pos_sin.type_as(q_), pos_cos.type_as(q_)
            q_ = self._apply_rotary_pos_emb(pos_sin[None, None, :, :], pos_cos[None, None, :, :], q_)
            k_ = self._apply_rotary_pos_emb(pos_sin[None, None, :, :], pos_cos[None, None, :, :], k_)
        return q_.type_as(q), k_.type_as(k)


class OLMoAttention(nn.Module):
    """OLMo-core's Attention as OLMo 2 configures it: ``w_q``, ``w_k``, ``w_v``, ``w_out`` without bias, the query and
    key norms over all heads (``q_norm``, ``k_norm``), rotary positions, grouped-query heads for the causal SDPA."""

    def __init__(self, kv_heads=2):
        super().__init__()
        self.kv_heads = kv_heads
        self.w_q = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.w_k = nn.Linear(D, kv_heads * HEAD_DIM, bias=False)
        self.w_v = nn.Linear(D, kv_heads * HEAD_DIM, bias=False)
        self.w_out = nn.Linear(HEADS * HEAD_DIM, D, bias=False)
        self.q_norm = OLMoRMSNorm(HEADS * HEAD_DIM)
        self.k_norm = OLMoRMSNorm(kv_heads * HEAD_DIM)
        self.rope = OLMoRotaryEmbedding()

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.q_norm(self.w_q(x)), self.k_norm(self.w_k(x)), self.w_v(x)
        q = q.view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2)
        q, k = self.rope(q, k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.w_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


class OLMoFeedForward(nn.Module):
    """OLMo-core's FeedForward: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, FFN, bias=False)
        self.w2 = nn.Linear(FFN, D, bias=False)
        self.w3 = nn.Linear(D, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class OLMoReorderedNormBlock(nn.Module):
    """OLMo-core's ReorderedNormTransformerBlock (OLMo 2): the norms after attention and after the MLP."""

    def __init__(self):
        super().__init__()
        self.attention, self.attention_norm = OLMoAttention(), OLMoRMSNorm(D)
        self.feed_forward, self.feed_forward_norm = OLMoFeedForward(), OLMoRMSNorm(D)

    def forward(self, x):
        h = x + self.attention_norm(self.attention(x))
        return h + self.feed_forward_norm(self.feed_forward(h))


class OLMoLMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.w_out = OLMoRMSNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, x):
        return self.w_out(self.norm(x))


class OLMoTransformer(nn.Module):
    """OLMo-core's Transformer: ``embeddings``, ``blocks`` (a ModuleDict keyed by layer index), ``lm_head``."""

    def __init__(self, layers=2):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleDict({str(i): OLMoReorderedNormBlock() for i in range(layers)})
        self.lm_head = OLMoLMHead()

    def forward(self, input_ids):
        h = self.embeddings(input_ids)
        for block in self.blocks.values():
            h = block(h)
        return self.lm_head(h)


class TitanFusedQKVLinear(nn.Module):
    """torchtitan's FusedQKVLinear (``torchtitan/models/common/attention.py``, the default of its Llama 3): one ``wqkv``
    linear whose output is viewed as ``[b, s, kv_heads, heads_per_kv + 2, head_dim]`` and split into q, k, v. Its
    checkpoints are in the unfused layout: a ``state_dict`` post-hook replaces ``wqkv.weight`` by new ``wq``, ``wk``,
    ``wv`` tensors cut from it, and a ``load_state_dict`` pre-hook joins them back, so ``state_dict()`` names tensors
    the module does not hold."""

    def __init__(self, kv_heads=2):
        super().__init__()
        self.head_dim, self.heads_per_kv = HEAD_DIM, HEADS // kv_heads
        self.r_dim = self.heads_per_kv + 2
        self.wqkv = nn.Linear(D, kv_heads * self.r_dim * HEAD_DIM, bias=False)
        self.register_state_dict_post_hook(self._split_qkv_on_save)
        self.register_load_state_dict_pre_hook(self._merge_qkv_on_load)

    def forward(self, x):
        bs, seqlen, _ = x.shape
        qkv = self.wqkv(x).view(bs, seqlen, -1, self.r_dim, self.head_dim)
        xq, xk, xv = torch.split(qkv, [self.heads_per_kv, 1, 1], dim=-2)
        return (xq.reshape(bs, seqlen, -1, self.head_dim).contiguous(),
                xk.reshape(bs, seqlen, -1, self.head_dim).contiguous(),
                xv.reshape(bs, seqlen, -1, self.head_dim).contiguous())

    @staticmethod
    def _split_qkv_on_save(module, state_dict, prefix, local_metadata):
        hd, hpk, r = module.head_dim, module.heads_per_kv, module.r_dim
        key = f"{prefix}wqkv.weight"
        if key not in state_dict:
            return
        tensor = state_dict.pop(key)
        w = tensor.reshape(tensor.shape[0] // (r * hd), r, hd, tensor.shape[1])
        state_dict[f"{prefix}wq.weight"] = w[:, :hpk].reshape(-1, tensor.shape[1]).contiguous()
        state_dict[f"{prefix}wk.weight"] = w[:, hpk].reshape(-1, tensor.shape[1]).contiguous()
        state_dict[f"{prefix}wv.weight"] = w[:, hpk + 1].reshape(-1, tensor.shape[1]).contiguous()

    @staticmethod
    def _merge_qkv_on_load(module, state_dict, prefix, *args):
        hd, hpk = module.head_dim, module.heads_per_kv
        keys = [f"{prefix}{w}.weight" for w in ("wq", "wk", "wv")]
        if not all(k in state_dict for k in keys):
            return
        wq, wk, wv = (state_dict.pop(k) for k in keys)
        n_kv, tail = wk.shape[0] // hd, wq.shape[1]
        state_dict[f"{prefix}wqkv.weight"] = torch.cat(
            [wq.reshape(n_kv, hpk, hd, tail), wk.reshape(n_kv, 1, hd, tail), wv.reshape(n_kv, 1, hd, tail)],
            dim=1).reshape(-1, tail)


class TitanAttention(nn.Module):
    """torchtitan's GQAttention with its fused ``qkv_linear``, rotary positions and SDPA over ``[b, s, heads, hd]``."""

    def __init__(self, kv_heads=2):
        super().__init__()
        self.qkv_linear = TitanFusedQKVLinear(kv_heads)
        self.wo = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        xq, xk, xv = self.qkv_linear(x)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        xq, xk = apply_rope(xq, cos, sin), apply_rope(xk, cos, sin)
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).flatten(2))


class TitanFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, FFN, bias=False)
        self.w2 = nn.Linear(FFN, D, bias=False)
        self.w3 = nn.Linear(D, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(D, eps=1e-6), TitanAttention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(D, eps=1e-6), TitanFeedForward()

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanDecoder(nn.Module):
    """torchtitan's Llama 3 Decoder: ``tok_embeddings``, ``layers`` (a ModuleDict keyed by layer index), ``norm``,
    ``output``."""

    def __init__(self, layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleDict({str(i): TitanBlock() for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(D, eps=1e-6), nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        cos, sin = rope_cache(tokens.shape[1])
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


class PScan(torch.autograd.Function):
    """mambapy's parallel scan (``mambapy/pscan.py``, ``PScan``): ``H[t] = A[t] * H[t-1] + X[t]`` computed in place on
    views of clones of its inputs, with a backward of its own (the reverse scan of the gradient). Its sweeps are a
    plain loop here (mambapy's Blelloch sweeps update views in place alike): each step reads ``X[:, :, t - 1]`` and
    then updates ``X[:, :, t]``, a view of the same tensor, which autograd could not differentiate; eager autograd
    never records it (a Function's forward runs without gradients) and calls ``backward`` instead."""

    @staticmethod
    def scan(A, X):
        for t in range(1, X.size(2)):
            X[:, :, t].add_(A[:, :, t].mul(X[:, :, t - 1]))

    @staticmethod
    def forward(ctx, A_in, X_in):
        # cloning is required because of the in-place ops
        A = A_in.clone().transpose(2, 1)  # (B, D, L, N)
        X = X_in.clone().transpose(2, 1)
        PScan.scan(A, X)
        ctx.save_for_backward(A_in, X)
        return X.transpose(2, 1)

    @staticmethod
    def backward(ctx, grad_output_in):
        A_in, X = ctx.saved_tensors
        grad_output = grad_output_in.clone().transpose(2, 1)
        A = F.pad(A_in.transpose(2, 1)[:, :, 1:], (0, 0, 0, 1))  # shifted one step to the left
        for t in range(grad_output.size(2) - 2, -1, -1):  # the reverse scan, in place
            grad_output[:, :, t].add_(A[:, :, t].mul(grad_output[:, :, t + 1]))
        Q = torch.zeros_like(X)
        Q[:, :, 1:].add_(X[:, :, :-1] * grad_output[:, :, 1:])
        return Q.transpose(2, 1), grad_output.transpose(2, 1)


pscan = PScan.apply


class MambaBlock(nn.Module):
    """mambapy's MambaBlock (``mambapy/mamba.py``): ``in_proj``, a causal depthwise ``conv1d``, ``x_proj``,
    ``dt_proj``, ``A_log``, ``D``, ``out_proj``; its selective scan through ``pscan`` (mambapy's default) or, with
    ``use_pscan=False``, its sequential loop."""

    def __init__(self, d_state=8, expand=2, d_conv=4, dt_rank=4, use_pscan=True):
        super().__init__()
        self.d_inner, self.d_state, self.dt_rank, self.use_pscan = expand * D, d_state, dt_rank, use_pscan
        self.in_proj = nn.Linear(D, 2 * self.d_inner, bias=False)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(self.d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, self.d_inner, bias=True)
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, D, bias=False)

    def forward(self, x):
        _, L, _ = x.shape
        x, z = self.in_proj(x).chunk(2, dim=-1)
        x = F.silu(self.conv1d(x.transpose(1, 2))[:, :, :L].transpose(1, 2))
        y = self.ssm(x)
        return self.out_proj(y * F.silu(z))

    def ssm(self, x):
        A = -torch.exp(self.A_log.float())
        delta, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        deltaA = torch.exp(delta.unsqueeze(-1) * A)  # (B, L, ED, N)
        BX = (delta.unsqueeze(-1) * B.unsqueeze(2)) * x.unsqueeze(-1)
        if self.use_pscan:
            hs = pscan(deltaA, BX)
        else:
            h, hs = torch.zeros_like(BX[:, 0]), []
            for t in range(x.size(1)):
                h = deltaA[:, t] * h + BX[:, t]
                hs.append(h)
            hs = torch.stack(hs, dim=1)
        return (hs @ C.unsqueeze(-1)).squeeze(3) + self.D * x


class MambaResidualBlock(nn.Module):
    def __init__(self, use_pscan=True):
        super().__init__()
        self.mixer, self.norm = MambaBlock(use_pscan=use_pscan), nn.RMSNorm(D, eps=1e-5)

    def forward(self, x):
        return self.mixer(self.norm(x)) + x


class MambaLM(nn.Module):
    """mambapy's ``lm.LM``: ``embedding``, ``mamba.layers``, ``norm_f``, an untied ``lm_head``."""

    def __init__(self, layers=2, use_pscan=True):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D)
        self.mamba = nn.Module()
        self.mamba.layers = nn.ModuleList([MambaResidualBlock(use_pscan) for _ in range(layers)])
        self.norm_f, self.lm_head = nn.RMSNorm(D, eps=1e-5), nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.mamba.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))
