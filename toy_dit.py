"""The toy demo's base model: a diffusion transformer (DiT) in miniature, for 2-D points.

You do not need to read this file to learn JAGG: jagg.py only ever sees velocity_fn(z, t).
It is here so that the toy demo trains a genuine DiT (Peebles & Xie, "Scalable Diffusion
Models with Transformers", 2023): timestep and label embeddings, adaLN-Zero transformer blocks
with multi-head self-attention, and a final adaLN layer, as in DiT's models.py, at toy size.

From a point to tokens and back: a 2-D point x = (x_1, x_2) is a tiny "image" of 2 "pixels"
with patch size 1. Each coordinate becomes one token: its value and Fourier features of it,
projected to the hidden size, plus a learned position embedding that says which coordinate
it is. Self-attention lets the coordinates talk; the final layer maps each token back to the
velocity of its own coordinate. Shapes: B points, N = 2 tokens, H hidden size.

The flow convention is SD3's (rectified flow): z_t = (1 - t) x + t eps, t in [0, 1],
and the network predicts the velocity v = eps - x, so that dz/dt = v.

At the end, the data it is pretrained on: 4 "prompts" (class labels), each a mixture of
Gaussians in 2-D, small enough for a laptop CPU to pretrain in a minute.
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn


@dataclass
class ToyDiTConfig:
    num_classes: int = 4  # number of prompts (class labels)
    data_dim: int = 2  # coordinates per point = tokens per point
    hidden: int = 64  # hidden size H
    depth: int = 3  # transformer blocks
    heads: int = 4  # attention heads
    num_freqs: int = 6  # Fourier features per coordinate

    def to_dict(self):
        return asdict(self)


def modulate(x, shift, scale):
    # adaLN: x * (1 + scale) + shift, with shift/scale per sample, broadcast over tokens.
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    """Sinusoidal embedding of t (scaled to 0..1000 like DiT's timesteps), then an MLP."""

    def __init__(self, hidden, freq_dim=64):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t):
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)  # [F/2]
        args = 1000 * t[:, None].float() * freqs[None]  # [B, F/2]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))  # [B, H]


class Block(nn.Module):
    """A DiT block with adaLN-Zero conditioning."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * hidden, hidden))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        # x: [B, N, H], c: [B, H]
        modulation = self.adaLN_modulation(c).chunk(6, dim=1)  # 6 x [B, H]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation
        h = modulate(self.norm1(x), shift_msa, scale_msa)  # [B, N, H]
        x = x + gate_msa.unsqueeze(1) * self.attn(h, h, h, need_weights=False)[0]  # [B, N, H]
        h = modulate(self.norm2(x), shift_mlp, scale_mlp)  # [B, N, H]
        return x + gate_mlp.unsqueeze(1) * self.mlp(h)  # [B, N, H]


class FinalLayer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, 1)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm(x), shift, scale))  # [B, N, 1]


class ToyDiT(nn.Module):
    def __init__(self, cfg: ToyDiTConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden
        self.x_embed = nn.Linear(1 + 2 * cfg.num_freqs, H)
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.data_dim, H) * 0.02)
        self.t_embedder = TimestepEmbedder(H)
        self.y_embedder = nn.Embedding(cfg.num_classes, H)
        self.blocks = nn.ModuleList([Block(H, cfg.heads) for _ in range(cfg.depth)])
        self.final_layer = FinalLayer(H)
        freqs = 2.0 ** torch.arange(cfg.num_freqs) * math.pi / 4  # [F]
        self.register_buffer("freqs", freqs, persistent=False)
        self._init_weights()

    def _init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.y_embedder.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        # adaLN-Zero: every block's modulation starts at zero, so each block starts as the
        # identity (its gates are 0) and the network as a whole starts by predicting zero.
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def forward(self, x, t, y):
        """x: [B, 2] points, t: [B] flow times in [0, 1], y: [B] labels -> velocity [B, 2]."""
        # "Patchify": one token per coordinate, from its value and its Fourier features.
        xs = x.unsqueeze(-1)  # [B, N, 1]
        angles = xs * self.freqs  # [B, N, F]
        feats = torch.cat([xs, torch.sin(angles), torch.cos(angles)], dim=-1)  # [B, N, 1 + 2F]
        h = self.x_embed(feats) + self.pos_embed  # [B, N, H]
        c = self.t_embedder(t) + self.y_embedder(y)  # [B, H]
        for block in self.blocks:
            h = block(h, c)  # [B, N, H]
        # "Unpatchify": each token back to its coordinate's velocity.
        return self.final_layer(h, c).squeeze(-1)  # [B, N] = [B, 2]


def flow_matching_loss(model, x, y, generator=None):
    """Rectified-flow pretraining loss: || v_theta(z_t, t, y) - (eps - x) ||^2.

    t is drawn logit-normal (SD3's choice), which weights the middle of the path."""
    eps = torch.randn(x.shape, generator=generator, device=x.device)  # [B, 2]
    t = torch.sigmoid(torch.randn(x.shape[0], generator=generator, device=x.device))  # [B]
    z = (1 - t[:, None]) * x + t[:, None] * eps  # [B, 2]
    return ((model(z, t, y) - (eps - x)) ** 2).mean()


# === The toy data and the base model: 4 "prompts", each a mixture of Gaussians in 2-D ===
PROMPTS = {  # name (class label 0, 1, 2, 3): the modes of its distribution, Gaussians of std 0.2
    "ring": [(2.0 * torch.cos(torch.tensor(i * 3.14159 / 4)).item(),
              2.0 * torch.sin(torch.tensor(i * 3.14159 / 4)).item()) for i in range(8)],
    "grid": [(x, y) for x in (-2.0, 0.0, 2.0) for y in (-2.0, 0.0, 2.0)],
    "diagonal": [(s, s) for s in (-2.4, -0.8, 0.8, 2.4)],
    "corners": [(-2.0, -2.0), (-2.0, 2.0), (2.0, -2.0), (2.0, 2.0)],
}


def sample_data(labels):
    """Points of the prompts' distributions: labels [B] -> x [B, 2]."""
    x = torch.empty(len(labels), 2)
    for c, modes in enumerate(PROMPTS.values()):
        m = labels == c
        n = int(m.sum())
        x[m] = torch.tensor(modes)[torch.randint(len(modes), (n,))] + 0.2 * torch.randn(n, 2)
    return x


def pretrain(steps=2000, seed=0, batch=512, log_every=0):
    """A ToyDiT pretrained by flow matching on the prompts' distributions: the demo's base model.
    log_every > 0: a line of progress every that many steps."""
    torch.manual_seed(seed)
    model = ToyDiT(ToyDiTConfig(num_classes=len(PROMPTS)))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for step in range(1, steps + 1):
        labels = torch.randint(len(PROMPTS), (batch,))  # [B]
        loss = flow_matching_loss(model, sample_data(labels), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if log_every and step % log_every == 0:
            print(f"  pretraining step {step}/{steps}, flow-matching loss {loss.item():.3f}",
                  flush=True)
    return model


def checkpoint(model):
    """What load reads back: the config and the weights, tensors and plain data only."""
    return {"model_cfg": model.cfg.to_dict(), "model": model.state_dict()}


def load(path):
    """The ToyDiT saved at path by pretrain (weights only: no pickled code runs)."""
    ckpt = torch.load(path, weights_only=True)
    model = ToyDiT(ToyDiTConfig(**ckpt["model_cfg"]))
    model.load_state_dict(ckpt["model"])
    return model
