"""A diffusion transformer (DiT) in miniature, for 2-D points, small enough for a laptop CPU.

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

At the end, what train_toy.py needs that is neither the model nor GRPO: the toy data (4 "prompts",
each a mixture of Gaussians in 2-D), the pretraining that makes its base model, and its pictures.
"""

import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from PIL import Image, ImageDraw, ImageFont


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
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"), nn.Linear(4 * hidden, hidden))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        # x: [B, N, H], c: [B, H]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
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
        self.register_buffer("freqs", 2.0 ** torch.arange(cfg.num_freqs) * math.pi / 4, persistent=False)
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
        feats = torch.cat([xs, torch.sin(xs * self.freqs), torch.cos(xs * self.freqs)], dim=-1)  # [B, N, 1+2F]
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
PROMPTS = {  # name (class label 0, 1, 2, 3): the modes of its distribution, each a Gaussian of std 0.2
    "ring": [(2.0 * torch.cos(torch.tensor(i * 3.14159 / 4)).item(), 2.0 * torch.sin(torch.tensor(i * 3.14159 / 4)).item())
             for i in range(8)],
    "grid": [(x, y) for x in (-2.0, 0.0, 2.0) for y in (-2.0, 0.0, 2.0)],
    "diagonal": [(s, s) for s in (-2.4, -0.8, 0.8, 2.4)],
    "corners": [(-2.0, -2.0), (-2.0, 2.0), (2.0, -2.0), (2.0, 2.0)],
}


def sample_data(labels):
    """Points of the prompts' distributions: labels [B] -> x [B, 2]."""
    x = torch.empty(len(labels), 2)
    for c, modes in enumerate(PROMPTS.values()):
        m = labels == c
        x[m] = torch.tensor(modes)[torch.randint(len(modes), (int(m.sum()),))] + 0.2 * torch.randn(int(m.sum()), 2)
    return x


def pretrain(path, steps=2000, seed=0, batch=512):
    """A ToyDiT pretrained by flow matching on the prompts' distributions, saved at path (atomically)."""
    torch.manual_seed(seed)
    cfg = ToyDiTConfig(num_classes=len(PROMPTS))
    model = ToyDiT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        labels = torch.randint(len(PROMPTS), (batch,))  # [B]
        loss = flow_matching_loss(model, sample_data(labels), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"model_cfg": cfg.to_dict(), "model": model.state_dict()}, path + ".tmp")
    os.replace(path + ".tmp", path)  # a kill leaves no half-written checkpoint
    return model


def load(path):
    """The ToyDiT saved at path by pretrain (weights only: no pickled code runs)."""
    ckpt = torch.load(path, weights_only=True)
    model = ToyDiT(ToyDiTConfig(**ckpt["model_cfg"]))
    model.load_state_dict(ckpt["model"])
    return model


# === Pictures: the samples (base, then each method; a panel per prompt) and the reward over training ===
COLORS, FONT = {"base": (150, 150, 150), "exact": (40, 90, 200), "jagg": (230, 120, 20)}, ImageFont.load_default(size=16)


def samples_picture(rows, targets, size=200, lim=3.5):
    """rows {name: (x [E, 2], labels [E])}: one row of panels each; grey circles: the prompt's modes, red: its
    target (targets: one point per prompt)."""
    img = Image.new("RGB", (80 + size * len(PROMPTS), 30 + size * len(rows)), "white")
    d = ImageDraw.Draw(img)
    for i, (row, (x, labels)) in enumerate(rows.items()):
        d.text((6, 30 + i * size + size / 2), row, fill=COLORS[row], font=FONT, anchor="lm")
        for j, (name, modes) in enumerate(PROMPTS.items()):
            def circle(p, r, ox=80 + j * size, oy=30 + i * size):  # around the point p = (x1, x2), r pixels
                return [ox + (p[0] + lim) / (2 * lim) * size - r, oy + (lim - p[1]) / (2 * lim) * size - r,
                        ox + (p[0] + lim) / (2 * lim) * size + r, oy + (lim - p[1]) / (2 * lim) * size + r]
            d.text((80 + j * size + size / 2, 4), name, fill="black", font=FONT, anchor="mt")
            d.rectangle([80 + j * size, 30 + i * size, 80 + (j + 1) * size - 1, 30 + (i + 1) * size - 1], outline="grey")
            for p, r, color in [(m, 9, (200, 200, 200)) for m in modes] + [(targets[j], 11, "red")]:
                d.ellipse(circle(p, r), outline=color, width=2)
            for p in x[labels == j].tolist():
                d.ellipse(circle(p, 1), fill=COLORS[row])
    return img


def curve_picture(curves, size=(720, 400), box=(60, 40, 590, 350)):
    """curves {name: [(epoch, reward)]}: the evaluation reward over training, the legend beside the plot."""
    img, (left, top, right, bottom) = Image.new("RGB", size, "white"), box
    d, last = ImageDraw.Draw(img), max(e for c in curves.values() for e, _ in c)
    xy = lambda e, r: (left + e / last * (right - left), bottom - r * (bottom - top))  # noqa: E731 (r in [0, 1])
    d.rectangle(box, outline="black")
    d.text(((left + right) / 2, 10), "evaluation reward (mean, in (0, 1]) during GRPO", fill="black", font=FONT, anchor="mt")
    d.text(((left + right) / 2, size[1] - 8), "epoch", fill="black", font=FONT, anchor="md")
    for v in (0.0, 0.25, 0.5, 0.75, 1.0):
        d.text((left - 6, xy(0, v)[1]), f"{v:.2f}", fill="black", font=FONT, anchor="rm")
    for e in (0, last // 2, last):
        d.text((xy(e, 0)[0], bottom + 6), str(e), fill="black", font=FONT, anchor="mt")
    for i, (name, points) in enumerate(curves.items()):
        d.line([xy(e, r) for e, r in points], fill=COLORS[name], width=3)
        d.line([right + 12, top + 20 + 24 * i, right + 36, top + 20 + 24 * i], fill=COLORS[name], width=3)
        d.text((right + 42, top + 20 + 24 * i), name, fill="black", font=FONT, anchor="lm")
    return img
