"""A small, independent PyTorch DSpark drafter (tests only).

Written from SPEC sections 2-7 and 11 (not from the reference code): module
names follow the ``Qwen3DSparkModel`` state dict, so ``from_pretrained`` loads
a ``config.json`` + ``model.safetensors`` directory with a STRICT state dict
(missing or unexpected tensors fail). Validated against the reference fixture
``train_forward.npz``, it stands in for ``Qwen3DSparkModel.from_pretrained``
when checking our PyTorch exports.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope(x, pos, theta: float):
    """Rotate-half RoPE. x [B, T, heads, D]; pos [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[..., None] * inv
    ang = torch.cat([ang, ang], -1)[:, :, None, :]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * ang.cos().to(x.dtype) + rot * ang.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.nq, self.nkv, self.d = c["num_attention_heads"], c["num_key_value_heads"], d
        self.q_proj = nn.Linear(h, self.nq * d, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nq * d, h, bias=False)
        self.q_norm = RMSNorm(d, c["rms_norm_eps"])
        self.k_norm = RMSNorm(d, c["rms_norm_eps"])
        self.theta = c["theta"]

    def forward(self, x, x_pos, ctx, ctx_pos, visible):
        """x [B, T, H] queries (and block keys); ctx [B, S, H]; visible [B, T, S+T] bool."""
        b, t, _ = x.shape
        s = ctx.shape[1]
        q = rope(self.q_norm(self.q_proj(x).view(b, t, self.nq, self.d)), x_pos, self.theta)
        kv_in = torch.cat([ctx, x], 1)
        kv_pos = torch.cat([ctx_pos, x_pos], 1)
        k = rope(self.k_norm(self.k_proj(kv_in).view(b, s + t, self.nkv, self.d)), kv_pos, self.theta)
        v = self.v_proj(kv_in).view(b, s + t, self.nkv, self.d)
        rep = self.nq // self.nkv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * self.d ** -0.5
        m = visible[:, None]
        scores = scores.masked_fill(~m, float("-inf"))
        probs = torch.softmax(scores, -1)
        probs = torch.nan_to_num(probs, nan=0.0).to(v.dtype)  # rows that see nothing -> 0
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, self.nq * self.d)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, x_pos, ctx, ctx_pos, visible):
        x = x + self.self_attn(self.input_layernorm(x), x_pos, ctx, ctx_pos, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        v, h, r = c["vocab_size"], c["hidden_size"], c["markov_rank"]
        self.kind, self.r = c["markov_head_type"], r
        self.markov_w1 = nn.Embedding(v, r)
        self.markov_w2 = nn.Linear(r, v, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(h + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + h, 3 * r)

    def forward(self, prev, hidden):
        """prev [..., G]; hidden [..., G, H] -> bias [..., G, V] (teacher forcing)."""
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return self.markov_w2(e)
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([hidden, e], -1))) * e)
        s = torch.zeros(*prev.shape[:-1], self.r, dtype=hidden.dtype)
        out = []
        for k in range(prev.shape[-1]):
            a, c_, o = self.joint_proj(torch.cat([s, e[..., k, :], hidden[..., k, :]], -1)).chunk(3, -1)
            g = torch.sigmoid(a)
            s = g * s + (1 - g) * torch.tanh(c_)
            out.append(self.markov_w2(torch.tanh(o)))
        return torch.stack(out, -2)


class ConfidenceHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, 1)


class TorchDSpark(nn.Module):
    """DSpark drafter with the reference's parameter names (SPEC section 11)."""

    def __init__(self, hf: dict):
        super().__init__()
        theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]
        c = dict(hf, theta=float(theta),
                 head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
        self.c = c
        h, v, n = c["hidden_size"], c["vocab_size"], len(c["target_layer_ids"])
        self.embed_tokens = nn.Embedding(v, h)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(h, c["rms_norm_eps"])
        self.hidden_norm = RMSNorm(h, c["rms_norm_eps"])
        self.fc = nn.Linear(n * h, h, bias=False)
        self.lm_head = nn.Linear(h, v, bias=False)
        r = c.get("markov_rank", 0)
        self.markov_head = MarkovHead(c) if r > 0 else None
        self.conf_markov = bool(c.get("enable_confidence_head") and c.get("confidence_head_with_markov") and r > 0)
        self.confidence_head = (ConfidenceHead(h + (r if self.conf_markov else 0))
                                if c.get("enable_confidence_head") else None)

    @classmethod
    def from_pretrained(cls, directory) -> "TorchDSpark":
        from safetensors.torch import load_file

        d = Path(directory)
        hf = json.loads((d / "config.json").read_text())
        assert hf["architectures"] == ["Qwen3DSparkModel"], hf["architectures"]
        model = cls(hf)
        sd = load_file(str(d / "model.safetensors"))
        dtypes = {t.dtype for t in sd.values()}
        assert len(dtypes) == 1, dtypes
        model.to(dtypes.pop())
        model.load_state_dict(sd, strict=True)
        return model.eval()

    @torch.no_grad()
    def training_forward(self, input_ids, target_hidden_states, loss_mask, anchor_positions,
                         block_keep_mask, target_last_hidden_states=None) -> dict:
        """Same inputs/outputs as ``dspark_jax.draft.model.training_forward`` (torch tensors)."""
        c = self.c
        g, mask_id = c["block_size"], c["mask_token_id"]
        b, s = input_ids.shape
        n = anchor_positions.shape[1]
        a = anchor_positions.long()
        keep = block_keep_mask.bool()
        # labels / eval mask (SPEC 6)
        raw = a[:, :, None] + torch.arange(1, g + 1)
        safe = torch.where(keep[:, :, None], raw.clamp(max=s - 1), torch.zeros_like(raw))
        labels = torch.gather(input_ids, 1, safe.view(b, -1)).view(b, n, g)
        lm = torch.gather(loss_mask.float(), 1, safe.view(b, -1)).view(b, n, g) > 0.5
        valid = (raw < s) & lm & keep[:, :, None]
        eval_mask = torch.cumprod(valid.long(), -1).bool()
        # block inputs [x0, MASK...] (all MASK when not kept)
        anchor_tok = torch.gather(input_ids, 1, a)
        block = torch.full((b, n, g), mask_id, dtype=torch.long)
        block[:, :, 0] = torch.where(keep, anchor_tok, torch.full_like(anchor_tok, mask_id))
        # context and visibility (SPEC 2-3)
        dt = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(target_hidden_states.to(dt)))
        ctx_pos = torch.arange(s).expand(b, s)
        x_pos = (a[:, :, None] + torch.arange(g)).reshape(b, n * g)
        blk_of_q = torch.arange(n).repeat_interleave(g)
        vis_ctx = (torch.arange(s)[None, None, :] < a[:, :, None]) & keep[:, :, None]  # [B, N, S]
        vis_ctx = vis_ctx.repeat_interleave(g, dim=1)                                # [B, NG, S]
        same = blk_of_q[:, None] == blk_of_q[None, :]
        vis_blk = same[None] & keep.repeat_interleave(g, dim=1)[:, :, None]
        visible = torch.cat([vis_ctx, vis_blk], -1)
        x = self.embed_tokens(block).view(b, n * g, -1)
        for layer in self.layers:
            x = layer(x, x_pos, ctx, ctx_pos, visible)
        hidden = self.norm(x).view(b, n, g, -1)
        logits = self.lm_head(hidden).float()
        prev = torch.cat([anchor_tok[..., None], labels[..., :-1]], -1)
        if self.markov_head is not None:
            logits = logits + self.markov_head(prev, hidden).float()
        conf = None
        if self.confidence_head is not None:
            feat = hidden
            if self.conf_markov:
                feat = torch.cat([hidden, self.markov_head.markov_w1(prev)], -1)
            conf = self.confidence_head.proj(feat)[..., 0].float()
        aligned = None
        if target_last_hidden_states is not None:
            idx = (safe - 1).clamp(min=0).view(b, -1)
            th = torch.gather(target_last_hidden_states.to(dt), 1,
                              idx[..., None].expand(-1, -1, target_last_hidden_states.shape[-1]))
            aligned = self.lm_head(th.view(b, n, g, -1)).float()
        return {"draft_logits": logits, "confidence_logits": conf, "target_ids": labels,
                "eval_mask": eval_mask, "aligned_target_logits": aligned}
