"""JAGG on your own model, before you train with it: the velocity_fn, its checks, and JAGG measured on it.

    python examples/your_model.py        # seconds on a CPU; tests/test_example.py runs it too

Replace Net, the prompts and reward() with yours. The conventions jagg.py assumes are stated where
they apply (CONVENTION): getting one wrong does not crash, it trains the wrong thing. Then train:
train_toy.py's loop is the whole GRPO loop to copy (its make_velocity_fn and reward_fn are the two
places your model and reward go), and docs/your_trainer.md puts the same call into Flow-GRPO's.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jagg  # noqa: E402
from beyond_paper import checks, options, probe  # noqa: E402

T, NOISE_LEVEL, CFG_SCALE, GROUP, PROMPTS, WINDOW = 10, 0.7, 4.5, 8, 4, 4


class Net(torch.nn.Module):
    """A conditional velocity model v(x, sigma, c): any network with this signature will do."""

    def __init__(self, d=2, n_prompts=PROMPTS, h=64):
        super().__init__()
        self.embed = torch.nn.Embedding(n_prompts + 1, h)  # the last id is the empty prompt (CFG)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(d + 1 + h, h), torch.nn.SiLU(), torch.nn.Linear(h, d))

    def forward(self, x, sigma, c):  # x [N, d], sigma [N], c [N] -> v [N, d]
        return self.net(torch.cat([x, sigma[:, None], self.embed(c)], dim=-1))


def make_velocity_fn(model, c):
    """jagg's contract: velocity_fn(z [S, B, *D], t [S, B]) -> v [S, B, *D] for the B samples whose
    prompts are c [B]. CONVENTION: t is sigma (1 = pure noise, 0 = data) and v = noise - data,
    the rectified flow of SD3 and Flow-GRPO; a model trained with another convention must be
    converted here (SD3's transformer takes timestep = sigma * 1000)."""
    def velocity_fn(z, t):
        S, B = t.shape
        x = z.reshape(S * B, *z.shape[2:])  # [S*B, *D]: a sample keeps its own shape (C, H, W)
        # CONVENTION: rows are step-major (row s * B + b is sample b at step s), so the
        # conditioning is repeated S times as a block: c.repeat(S) (embeddings [B, L, E]:
        # .repeat(S, 1, 1)), never repeat_interleave, which would pair each state with another
        # sample's prompt.
        s, cs = t.reshape(S * B), c.repeat(S)  # [S*B], [S*B]
        v_c = model(x, s, cs)  # [S*B, *D]: the conditional branch carries the graph when training
        with torch.no_grad():  # CFG's unconditional branch: no graph (Flow-GRPO's, train_sd.py's)
            v_u = model(x, s, torch.full_like(cs, PROMPTS))
        return (v_u + CFG_SCALE * (v_c - v_u)).reshape(z.shape)  # [S, B, *D]
    return velocity_fn


def reward(x, c):  # [B]: here, closeness to a target point per prompt
    return -(x - torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])[c]).norm(dim=-1)


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def main(seed=0):
    torch.manual_seed(seed)
    model = Net()
    model.eval()  # CONVENTION: no dropout in rollouts or training, else the first ratio is not 1
    sigmas = jagg.sigma_schedule(T, shift=3.0)  # [T + 1]; yours: your scheduler's own sigmas
    # 1. Once, before training: v of z's shape, no dropout, S steps at once equal to S single
    # steps (the conditioning repeated as a block). A ValueError names the mistake and its fix.
    # With a diffusers pipeline, also checks.check_against_pipeline (examples/check_sd3.py).
    checks.check_velocity_fn(make_velocity_fn(model, torch.arange(PROMPTS)), torch.randn(PROMPTS, 2), sigmas)
    # 2. One rollout of GROUP samples per prompt, and its group-relative advantages.
    # CONVENTION: the same noise_level for rollout and loss (the loss refuses a mismatch).
    c = torch.arange(PROMPTS).repeat_interleave(GROUP)  # [B]
    traj = jagg.rollout(make_velocity_fn(model, c), torch.randn(len(c), 2), sigmas, NOISE_LEVEL)
    adv = jagg.group_advantages(reward(traj.sample, c), c)  # [B]; under torchrun, all ranks' rewards
    cfg = jagg.LossConfig(noise_level=NOISE_LEVEL, clip_range=0.2)
    # 3. The batch's gradient both ways, as a trainer calls it: exact GRPO (jagg_frac 0), then the
    # paper's JAGG on every window. What JAGG saves is the rows with grad; what it costs, the cosine.
    grads = {}
    for name, jagg_frac in (("exact", 0.0), ("jagg", 1.0)):
        model.zero_grad(set_to_none=True)
        stats, routed = jagg.backward_batch(make_velocity_fn(model, c), traj, adv, cfg, WINDOW, jagg_frac)
        grads[name] = flat_grad(model)
        print(f"{name}: {stats['grad_rows']} rows with grad, windows by JAGG {routed}")
    cosine = torch.nn.functional.cosine_similarity(grads["exact"], grads["jagg"], dim=0).item()
    print(f"cosine of JAGG's gradient to exact's on this batch: {cosine:.4f}")
    # 4. The probe, per window: JAGG's error over an optimizer step's own noise (below ~0.1: lost in
    # it; near 1: train that window exactly, with jagg_frac < 1, or use a smaller WINDOW).
    def fns(idx):  # the velocity_fn of the samples idx, and the KL reference's (none here)
        return make_velocity_fn(model, c[idx]), None
    measured = probe.probe_segments(fns, model.parameters(), traj, adv, cfg, options.JaggOptions(WINDOW),
                                    train_batch=16)
    print(f"probe per window: cosine {[round(x, 3) for x in measured['cosine']]}, "
          f"error_to_noise {[round(x, 3) for x in measured['error_to_noise']]}")
    return cosine, measured


if __name__ == "__main__":
    main()
