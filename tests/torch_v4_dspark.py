"""An independent PyTorch reference of DeepSeek-V4's in-checkpoint DSpark module, written from the facts
in shared/reference/DEEPSEEK_V4.md ("The DSpark module inside the checkpoint") and the engines' code
it names (vLLM ``vllm/models/deepseek_v4/nvidia/dspark.py``, SGLang
``python/sglang/srt/models/deepseek_v4_dspark.py``). No CPU reference of the module exists, so this one
reads the checkpoint's own tensors (upstream names, torch layout) and computes each block with plain
per-token / per-block loops: it shares no code with ``dspark_jax``.

One block at anchor position a (the last committed token): inputs [x_a, noise, ...] at positions
a .. a+G-1; every block query attends to the context rows of positions max(0, a-W) .. a-1 (W =
``sliding_window``) and to all G block rows; h_k = hc_head(streams); logits_k = head(norm(h_k)) +
markov_w2 markov_w1[x_{k-1}]; confidence_k = proj [h_k ; markov_w1[x_{k-1}]].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x, w=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def rotate(x, positions, theta, rope_dim, inverse=False):
    """Rotate the last ``rope_dim`` dims of x [T, ..., D] as complex pairs (a + ib) at positions [T]."""
    freqs = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    ang = positions.double()[:, None] * freqs[None, :]                         # [T, r/2]
    rot = torch.polar(torch.ones_like(ang), -ang if inverse else ang).to(torch.complex64)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    pairs = torch.view_as_complex(x[..., -rope_dim:].float().reshape(*x.shape[:-1], rope_dim // 2, 2).contiguous())
    out = torch.view_as_real(pairs * rot.reshape(shape)).reshape(*x.shape[:-1], rope_dim)
    return torch.cat([x[..., :-rope_dim], out], dim=-1)


class Module:
    """The DSpark module from torch-named tensors ``sd`` (``mtp.*`` plus the target's ``embed.weight``
    and ``head.weight``) and the V4 ``config.json`` dict ``hf``."""

    def __init__(self, sd: dict, hf: dict):
        self.sd = {k: torch.as_tensor(v).float() for k, v in sd.items()}
        self.hf = hf
        self.stages = len(hf["dspark_target_layer_ids"])
        self.n_hc = hf["hc_mult"]
        self.eps = hf["rms_norm_eps"]
        self.hc_eps = hf["hc_eps"]
        self.n_heads, self.d = hf["num_attention_heads"], hf["head_dim"]
        self.rope = hf["qk_rope_head_dim"]
        self.window = hf["sliding_window"]
        self.gamma = hf["dspark_block_size"]
        self.noise = hf["dspark_noise_token_id"]

    def w(self, name):
        return self.sd[name]

    # ---------------------------------------------------------------- pieces
    def hc(self, s, which, streams):
        """(pre [T, N], post [T, N], comb [T, N, N]) of stage s's ``hc_{which}``."""
        n = self.n_hc
        fn, base, scale = (self.w(f"mtp.{s}.hc_{which}_{k}") for k in ("fn", "base", "scale"))
        mix = rms(streams.flatten(1), eps=self.eps) @ fn.T
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = torch.softmax(mix[:, 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n), -1) + self.hc_eps
        comb = comb / (comb.sum(1, keepdim=True) + self.hc_eps)
        for _ in range(self.hf["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(2, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(1, keepdim=True) + self.hc_eps)
        return pre, post, comb

    def context_kv(self, s, main_x, positions):
        """Stage s's context rows [T, D]: kv_norm(wkv(main_x)) rotated at ``positions``."""
        kv = rms(main_x @ self.w(f"mtp.{s}.attn.wkv.weight").T, self.w(f"mtp.{s}.attn.kv_norm.weight"), self.eps)
        return rotate(kv, positions, self.hf["rope_theta"], self.rope)

    def attention(self, s, x, positions, ctx):
        """x [G, H] (normed block rows) at positions [G]; ctx [C, D] the visible context rows."""
        p = f"mtp.{s}.attn."
        q = rms(x @ self.w(p + "wq_a.weight").T, self.w(p + "q_norm.weight"), self.eps) @ self.w(p + "wq_b.weight").T
        q = rotate(rms(q.view(-1, self.n_heads, self.d), eps=self.eps), positions, self.hf["rope_theta"], self.rope)
        kv = rotate(rms(x @ self.w(p + "wkv.weight").T, self.w(p + "kv_norm.weight"), self.eps),
                    positions, self.hf["rope_theta"], self.rope)
        keys = torch.cat([ctx, kv], 0)                                            # [C + G, D]
        scores = torch.einsum("ghd,cd->hgc", q, keys) / self.d ** 0.5
        sink = self.w(p + "attn_sink")[:, None, None].expand(-1, x.shape[0], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        out = torch.einsum("hgc,cd->ghd", probs, keys)
        out = rotate(out, positions, self.hf["rope_theta"], self.rope, inverse=True)
        groups, rank = self.hf["o_groups"], self.hf["o_lora_rank"]
        grouped = out.reshape(x.shape[0], groups, -1)
        wo_a = self.w(p + "wo_a.weight").view(groups, rank, -1)
        return torch.einsum("gci,cri->gcr", grouped, wo_a).reshape(x.shape[0], -1) @ self.w(p + "wo_b.weight").T

    def moe(self, s, x):
        p, lim = f"mtp.{s}.ffn.", self.hf["swiglu_limit"]

        def expert(prefix, v):
            gate = torch.clamp(v @ self.w(prefix + "w1.weight").T, max=lim)
            up = torch.clamp(v @ self.w(prefix + "w3.weight").T, -lim, lim)
            return (F.silu(gate) * up) @ self.w(prefix + "w2.weight").T

        out = []
        for v in x:                                                              # one token at a time
            scores = torch.sqrt(F.softplus(v @ self.w(p + "gate.weight").T))
            chosen = torch.topk(scores + self.w(p + "gate.bias"), self.hf["num_experts_per_tok"]).indices
            weights = scores[chosen] / scores[chosen].sum() * self.hf["routed_scaling_factor"]
            y = expert(p + "shared_experts.", v)
            for wgt, e in zip(weights, chosen.tolist()):
                y = y + wgt * expert(f"{p}experts.{e}.", v)
            out.append(y)
        return torch.stack(out)

    def stage(self, s, streams, positions, ctx):
        pre, post, comb = self.hc(s, "attn", streams)
        x = rms((pre[..., None] * streams).sum(1), self.w(f"mtp.{s}.attn_norm.weight"), self.eps)
        y = self.attention(s, x, positions, ctx)
        streams = post[..., None] * y[:, None] + torch.einsum("tnm,tnh->tmh", comb, streams)
        pre, post, comb = self.hc(s, "ffn", streams)
        x = rms((pre[..., None] * streams).sum(1), self.w(f"mtp.{s}.ffn_norm.weight"), self.eps)
        return post[..., None] * self.moe(s, x)[:, None] + torch.einsum("tnm,tnh->tmh", comb, streams)

    # ---------------------------------------------------------------- the module
    def main_x(self, features):
        """features [T, n*H] (stream means of the tapped layers) -> [T, H]."""
        return rms(features.float() @ self.w("mtp.0.main_proj.weight").T, self.w("mtp.0.main_norm.weight"), self.eps)

    def block(self, anchor_token: int, a: int, ctx_rows: list):
        """h [G, H] (pre-norm) of the block at anchor position a; ctx_rows[s]: stage s's rows of
        positions 0 .. a-1 (at least), [>= a, D]."""
        last = self.stages - 1
        ids = torch.tensor([anchor_token] + [self.noise] * (self.gamma - 1))
        positions = torch.arange(a, a + self.gamma)
        streams = self.w("embed.weight")[ids][:, None].repeat(1, self.n_hc, 1)
        lo = max(0, a - self.window)
        for s in range(self.stages):
            streams = self.stage(s, streams, positions, ctx_rows[s][lo:a])
        fn, base, scale = (self.w(f"mtp.{last}.hc_head_{k}") for k in ("fn", "base", "scale"))
        pre = torch.sigmoid(rms(streams.flatten(1), eps=self.eps) @ fn.T * scale[0] + base) + self.hc_eps
        return (pre[..., None] * streams).sum(1)

    def heads(self, h, prev):
        """(logits [G, V] with the Markov bias of prev [G], confidence logits [G]) of h [G, H]."""
        last = f"mtp.{self.stages - 1}."
        base = rms(h, self.w(last + "norm.weight"), self.eps) @ self.w("head.weight").T
        e = self.w(last + "markov_head.markov_w1.weight")[prev]
        logits = base + e @ self.w(last + "markov_head.markov_w2.weight").T
        conf = (torch.cat([h, e], -1) @ self.w(last + "confidence_head.proj.weight").T)[:, 0]
        return logits, conf


def loss_terms(logits, conf, labels, target_logits, valid, decay_gamma=4.0):
    """CE, L1 and confidence-BCE losses (each weighted by exp(-k / decay_gamma) over valid positions)
    of stacked blocks: logits / target_logits [M, G, V], conf [M, G], labels [M, G], valid [M, G] bool."""
    g = labels.shape[-1]
    w = valid.float() * torch.exp(-torch.arange(g, dtype=torch.float32) / decay_gamma)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(w)
    l1 = (torch.softmax(logits, -1) - torch.softmax(target_logits, -1)).abs().sum(-1)
    c_star = torch.clamp(1 - 0.5 * l1, 0, 1)
    bce = F.binary_cross_entropy_with_logits(conf, c_star, reduction="none")
    den = w.sum() + 1e-6
    return {"ce_loss": (ce * w).sum() / den, "l1_loss": (l1 * w).sum() / den,
            "confidence_loss": (bce * w).sum() / den}
