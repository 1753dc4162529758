"""The mini SD3 model: SD3.5's pipeline at a small size, pretrained once on lab/mini_sd3.py's task.

    python lab/mini_sd3_pipeline.py            # builds and pretrains it once (about 10 min on 2
                                               # cores), prints its folder (runs/cache/mini_sd3_...)
    python lab/mini_sd3_pipeline.py --out DIR  # ... into DIR; DIR/prompts.txt: its 48 task prompts
    python lab/sd_runner.py --model DIR --prompts DIR/prompts.txt --reward lab.mini_sd3:geneval_reward
    python lab/sd_runner.py $(python lab/presets.py mini) --method compare   # the docs' setting

You do not need to read this file to learn JAGG: it is the model, not the algorithm. Real SD3.5
weights cannot be downloaded on the machines this project is built on, so this file makes a
pipeline that `lab/sd_runner.py --model DIR` trains like any other, on the task of lab/mini_sd3.py
(its prompt grammar, the scenes it renders, the rewards that check them):

- build_pipeline: a diffusers StableDiffusion3Pipeline with SD3.5's parts at a small size: two
  CLIP-shaped text encoders and a T5-shaped one (random and frozen, as SD3 keeps its encoders
  frozen; tokenizers built here over the grammar's words), an AutoencoderKL, an MMDiT-X
  SD3Transformer2DModel (dual attention and RMS qk-norm, as SD3.5-medium) and
  FlowMatchEulerDiscreteScheduler(shift=3.0).
- pretrain: the VAE as an autoencoder, then the transformer by rectified flow on its latents,
  conditioned through the three text encoders, with prompt dropout so that classifier-free
  guidance works. cached_pipeline saves it with save_pretrained (in runs/cache/ or --out) and
  reuses it.
"""

import collections
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

# lab/ on the path: mini_sd3 by its own name, whether this is run, imported as mini_sd3_pipeline
# (lab/ on the path) or as lab.mini_sd3_pipeline (from the repository's root)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mini_sd3 import WORDS, render, sample_prompt, training_prompts

# =====================================================================================
# 1. The pipeline: SD3.5's parts at a small size
# =====================================================================================

SIZES = {
    # The model the README's numbers come from: 32 px images, 16x16x4 latents, 64 image tokens.
    "base": dict(image=32, vae_channels=(32, 64), text_hidden=32, t5_hidden=64, layers=4, heads=4,
                 head_dim=32, dual_attention_layers=(0, 1)),
    # For tests: seconds to build and train.
    "tiny": dict(image=16, vae_channels=(8, 8), text_hidden=16, t5_hidden=32, layers=1, heads=2,
                 head_dim=8, dual_attention_layers=(0,)),
}
MAX_TOKENS = 16  # CLIP and T5 tokens per prompt: the longest prompt is 8 words


def _bpe_merges(words):
    """A BPE merge list under which every word is one token (a few lines of BPE training:
    merge the most frequent adjacent pair until every word is whole)."""
    seqs = {w: list(w[:-1]) + [w[-1] + "</w>"] for w in words}
    merges = []
    while any(len(s) > 1 for s in seqs.values()):
        pairs = collections.Counter(p for s in seqs.values() for p in zip(s, s[1:]))
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build_tokenizers():
    """CLIP's BPE tokenizer and T5's Unigram tokenizer over the grammar's words; any other word
    falls back to letters (CLIP) or <unk> (T5)."""
    from transformers import CLIPTokenizer, T5Tokenizer

    merges = _bpe_merges(WORDS)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    clip = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_TOKENS)
    pieces = ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
              + [("\u2581" + w, 0.0) for w in WORDS])
    t5 = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_TOKENS)
    return clip, t5


def build_pipeline(size="base", seed=0):
    """A StableDiffusion3Pipeline with random weights, every part SD3.5's kind."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    p = SIZES[size]
    torch.manual_seed(seed)
    clip_tok, t5_tok = build_tokenizers()

    # CLIP-L and CLIP-G shaped: SD3 takes the penultimate layer and the projected pooled output
    def clip_encoder():
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=p["text_hidden"],
            intermediate_size=2 * p["text_hidden"], projection_dim=p["text_hidden"],
            num_attention_heads=2, num_hidden_layers=2, max_position_embeddings=MAX_TOKENS,
            bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_act="gelu"))

    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=p["t5_hidden"],
                                 d_kv=p["t5_hidden"] // 4, d_ff=2 * p["t5_hidden"], num_layers=2,
                                 num_heads=4, pad_token_id=0, eos_token_id=1,
                                 decoder_start_token_id=0))
    latent = p["image"] // 2 ** (len(p["vae_channels"]) - 1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=p["vae_channels"],
                        latent_channels=4, layers_per_block=1, norm_num_groups=8,
                        sample_size=p["image"], mid_block_add_attention=False,
                        down_block_types=("DownEncoderBlock2D",) * len(p["vae_channels"]),
                        up_block_types=("UpDecoderBlock2D",) * len(p["vae_channels"]),
                        use_quant_conv=False,
                        use_post_quant_conv=False)  # SD3's VAE has no quant convs
    # SD3 pads the concatenated CLIP states (2 x text_hidden) to T5's width: joint_attention_dim.
    transformer = SD3Transformer2DModel(
        sample_size=latent, patch_size=2, in_channels=4, out_channels=4, num_layers=p["layers"],
        attention_head_dim=p["head_dim"], num_attention_heads=p["heads"],
        joint_attention_dim=p["t5_hidden"], caption_projection_dim=p["heads"] * p["head_dim"],
        pooled_projection_dim=2 * p["text_hidden"], pos_embed_max_size=latent,
        dual_attention_layers=p["dual_attention_layers"], qk_norm="rms_norm")
    pipe = StableDiffusion3Pipeline(transformer=transformer,
                                    scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
                                    text_encoder=clip_encoder(), tokenizer=clip_tok,
                                    text_encoder_2=clip_encoder(), tokenizer_2=clip_tok,
                                    text_encoder_3=t5, tokenizer_3=t5_tok)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# =====================================================================================
# 2. Pretraining: the VAE, then the transformer by rectified flow
# =====================================================================================


@dataclass
class PretrainConfig:
    size: str = "base"
    seed: int = 0
    vae_steps: int = 300
    vae_batch: int = 32
    vae_lr: float = 1e-3
    steps: int = 1600  # transformer steps
    batch: int = 64
    lr: float = 1e-3
    warmup: int = 200
    ema_decay: float = 0.999
    prompt_dropout: float = 0.1  # the unconditional branch of CFG is the empty prompt
    data: int = 16384  # rendered training images, encoded once
    shift: float = 3.0  # the scheduler's: timesteps are drawn where sampling spends them


def render_batch(prompts, rng, size):
    """Rendered images as a tensor in [-1, 1]: [B, 3, size, size]."""
    x = np.stack([np.asarray(render(p, rng, size), dtype=np.float32)
                  for p in prompts])  # [B, H, W, 3]
    return torch.from_numpy(x).permute(0, 3, 1, 2) / 127.5 - 1


@torch.no_grad()
def encode_prompts(pipe, prompts):
    """{prompt: (prompt_embeds [L, E], pooled [P])} through the three encoders, as SD3 encodes."""
    out = {}
    for i in range(0, len(prompts), 64):
        chunk = prompts[i : i + 64]
        pe, _, pooled, _ = pipe.encode_prompt(prompt=chunk, prompt_2=None, prompt_3=None,
                                              device="cpu", do_classifier_free_guidance=False,
                                              max_sequence_length=MAX_TOKENS)
        out.update({p: (pe[j], pooled[j]) for j, p in enumerate(chunk)})
    return out


def flow_matching_loss(transformer, x0, embeds, pooled, sigma):
    """Rectified flow as SD3 trains it: z = (1 - sigma) x0 + sigma eps, the transformer predicts
    v = eps - x0 at timestep sigma * 1000."""
    eps = torch.randn_like(x0)
    s = sigma[:, None, None, None]
    z = (1 - s) * x0 + s * eps  # [B, C, h, w]
    v = transformer(hidden_states=z, timestep=sigma * 1000, encoder_hidden_states=embeds,
                    pooled_projections=pooled, return_dict=False)[0]
    return ((v - (eps - x0)) ** 2).mean()


def sample_sigmas(n, shift, generator):
    """Logit-normal times (SD3's), shifted like the sampler's schedule."""
    s = torch.sigmoid(torch.randn(n, generator=generator))
    return shift * s / (1 + (shift - 1) * s)


def pretrain(pipe, cfg, log=print):
    """Train the VAE, then the transformer, in place. Returns {"vae": [...], "flow": [...]}: the
    loss on a fixed held-out batch before and after each stage (so a caller can check it fell)."""
    rng, g = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    size = SIZES[cfg.size]["image"]
    vae, transformer = pipe.vae, pipe.transformer
    held_prompts = [sample_prompt(random.Random(10_000 + i)) for i in range(64)]
    held = render_batch(held_prompts, random.Random(99), size)  # [64, 3, H, W]
    history = {}

    # --- the VAE: an autoencoder on rendered images (MSE, a very small KL as SD's VAEs use)
    def vae_loss(x):
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=g)).sample
        return ((rec - x) ** 2).mean(), post.kl().mean()

    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr)
    with torch.no_grad():
        before = vae_loss(held)[0].item()
    for _ in tqdm(range(cfg.vae_steps), desc="pretrain VAE", dynamic_ncols=True,
                  disable=cfg.vae_steps < 50):
        x = render_batch([sample_prompt(rng) for _ in range(cfg.vae_batch)], rng, size)
        rec, kl = vae_loss(x)
        opt.zero_grad(set_to_none=True)
        (rec + 1e-6 * kl).backward()
        opt.step()
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        history["vae"] = [before, vae_loss(held)[0].item()]
    log(f"VAE reconstruction MSE on held-out images: {history['vae'][0]:.4f} -> "
        f"{history['vae'][1]:.4f}")

    # --- latents of a fixed rendered data set, scaled to unit variance as SD3's VAE config does
    prompts = [sample_prompt(rng) for _ in range(cfg.data)]
    with torch.no_grad():
        latents = torch.cat([
            vae.encode(render_batch(prompts[i : i + 256], rng, size)).latent_dist.mode()
            for i in range(0, cfg.data, 256)])  # [N, 4, h, w]
        shift_factor, scaling_factor = latents.mean().item(), 1 / latents.std().item()
        vae.register_to_config(shift_factor=shift_factor, scaling_factor=scaling_factor)
        latents = (latents - shift_factor) * scaling_factor
        held_lat = (vae.encode(held).latent_dist.mode() - shift_factor) * scaling_factor
    texts = encode_prompts(pipe, sorted(set(prompts) | set(held_prompts) | {""}))

    def conditioning(batch_prompts):
        pe = torch.stack([texts[p][0] for p in batch_prompts])  # [B, L, E]
        return pe, torch.stack([texts[p][1] for p in batch_prompts])  # [B, P]

    # --- the transformer: rectified flow on the latents, prompts dropped 10% of the time for CFG
    held_sigma = sample_sigmas(len(held_prompts), cfg.shift, torch.Generator().manual_seed(7))
    held_cond = conditioning(held_prompts)

    def held_loss():
        torch.manual_seed(1234)
        with torch.no_grad():
            return flow_matching_loss(transformer, held_lat, *held_cond, held_sigma).item()

    transformer.train().requires_grad_(True)
    ema = [p.detach().clone() for p in transformer.parameters()]
    opt = torch.optim.AdamW(transformer.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / cfg.warmup)
        * 0.5 * (1 + math.cos(math.pi * min(i, cfg.steps) / cfg.steps)))
    before = held_loss()
    bar = tqdm(range(cfg.steps), desc="pretrain transformer", dynamic_ncols=True,
               disable=cfg.steps < 50)
    running = None
    for i in bar:
        idx = torch.randint(cfg.data, (cfg.batch,), generator=g)
        batch_prompts = ["" if rng.random() < cfg.prompt_dropout else prompts[j]
                         for j in idx.tolist()]
        loss = flow_matching_loss(transformer, latents[idx], *conditioning(batch_prompts),
                                  sample_sigmas(cfg.batch, cfg.shift, g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        # an EMA of the weights: the saved model, smoother than the last step's
        with torch.no_grad():
            decay = min(cfg.ema_decay, (i + 1) / (i + 10))
            for e, p in zip(ema, transformer.parameters()):
                e.lerp_(p.detach(), 1 - decay)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if i % 50 == 0:
            bar.set_postfix(loss=f"{running:.4f}")
    with torch.no_grad():
        for e, p in zip(ema, transformer.parameters()):
            p.copy_(e)
    transformer.eval().requires_grad_(False)
    history["flow"] = [before, held_loss()]
    log(f"flow-matching loss on held-out latents: {history['flow'][0]:.4f} -> "
        f"{history['flow'][1]:.4f}")
    return history


def cache_path(cfg, cache="runs/cache"):
    return os.path.join(cache, f"mini_sd3_{cfg.size}_v{cfg.vae_steps}_s{cfg.steps}_b{cfg.batch}"
                               f"_seed{cfg.seed}")


def cached_pipeline(cfg=None, cache="runs/cache", log=print, out=None):
    """The folder of the pretrained mini pipeline (out, or one named for cfg in cache): built,
    pretrained and saved on first use (into a temporary folder renamed into place, so an
    interrupted build leaves nothing), then reused."""
    cfg = cfg or PretrainConfig()
    path = out or cache_path(cfg, cache)
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    log(f"pretraining the mini SD3 once ({cfg.size}: VAE {cfg.vae_steps} steps, transformer "
        f"{cfg.steps} steps of {cfg.batch}); it is cached in {path}")
    start = time.perf_counter()
    pipe = build_pipeline(cfg.size, cfg.seed)
    history = pretrain(pipe, cfg, log)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    # lab/sd_runner.py --prompts: the task's 48 prompts
    with open(os.path.join(tmp, "prompts.txt"), "w") as f:
        f.write("\n".join(training_prompts()) + "\n")
    with open(os.path.join(tmp, "pretrain.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "history": history,
                   "seconds": time.perf_counter() - start}, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    log(f"pretrained in {time.perf_counter() - start:.0f} s")
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="Build and pretrain the mini SD3 pipeline (cached in runs/cache).")
    for f in dataclasses.fields(PretrainConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                            default=f.default, choices=list(SIZES) if f.name == "size" else None)
    parser.add_argument("--cache", default="runs/cache", help="cache folder (without --out)")
    parser.add_argument("--out", default=None, help="the pipeline's folder (default: one named "
                                                    "for the settings in --cache)")
    args = vars(parser.parse_args(sys.argv[1:]))
    cache, out = args.pop("cache"), args.pop("out")
    print(cached_pipeline(PretrainConfig(**args), cache,
                          log=lambda *a: print(*a, file=sys.stderr), out=out))
