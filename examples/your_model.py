"""JAGG-GRPO on your own model: a runnable template with a plain PyTorch velocity network.

    python examples/your_model.py        # seconds on a CPU; tests/test_example.py runs it too

Replace Net, the prompts and reward() with yours. The conventions jagg.py assumes are stated
where they apply (CONVENTION); getting one wrong does not crash, it trains the wrong thing.
"""

import copy, os, sys  # noqa: E401

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jagg  # noqa: E402
from beyond_paper import checks, options, probe  # noqa: E402

T, NOISE_LEVEL, CFG_SCALE, GROUP, PROMPTS, MINIBATCH, WINDOW = 10, 0.7, 4.5, 8, 4, 16, 4


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
    converted here (e.g. SD3's transformer takes timestep = sigma * 1000)."""
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


def main(epochs=20, seed=0):
    torch.manual_seed(seed)
    model = Net()
    model.eval()  # CONVENTION: no dropout in rollouts or training, else the first ratio is not 1
    ref = copy.deepcopy(model).requires_grad_(False)  # the KL term's frozen reference (beta > 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sigmas = jagg.sigma_schedule(T, shift=3.0)  # [T + 1]
    # Once, before training: v of z's shape, no dropout, and S steps at once equal S single steps
    # (the conditioning repeated as a block). A ValueError names the mistake and its fix.
    checks.check_velocity_fn(make_velocity_fn(model, torch.arange(PROMPTS)),
                                 torch.randn(PROMPTS, 2), sigmas)
    # CONVENTION: the same noise_level for rollout and loss (the loss refuses a mismatch).
    cfg = jagg.LossConfig(noise_level=NOISE_LEVEL, clip_range=0.2, beta=0.04)
    paper = options.JaggOptions(window=WINDOW)  # the paper's JAGG, as the probe names it
    history = []
    for epoch in range(epochs):
        c = torch.arange(PROMPTS).repeat_interleave(GROUP)  # [B]: GROUP samples per prompt
        traj = jagg.rollout(make_velocity_fn(model, c), torch.randn(len(c), 2), sigmas, NOISE_LEVEL)
        r = reward(traj.sample, c)  # [B]; under torchrun, gather all ranks' rewards and prompt ids
        adv = jagg.group_advantages(r, c)  # per-prompt statistics: group ids are the prompt ids
        history.append(r.mean().item())
        perm = torch.randperm(len(c))
        if epoch % 5 == 0:  # the probe: JAGG's gradient against exact, per window, on 8 samples
            idx = perm[:8]

            def fns(i):  # the velocity_fns (model, reference) of the probe's samples idx[i]
                return make_velocity_fn(model, c[idx[i]]), make_velocity_fn(ref, c[idx[i]])
            measured = probe.probe_segments(fns, model.parameters(), traj.subset(idx), adv[idx],
                                            cfg, paper, train_batch=MINIBATCH)
            # error_to_noise: JAGG's error over an optimizer step's own sampling noise (below
            # ~0.1: lost in it; near 1: that window is better trained exactly, with
            # jagg_frac < 1 or a smaller WINDOW)
            print(f"probe: cosine {[round(x, 3) for x in measured['cosine']]}, "
                  f"error_to_noise {[round(x, 3) for x in measured['error_to_noise']]}")
        for idx in perm.split(MINIBATCH):  # slice the trajectories AND their conditioning alike
            opt.zero_grad(set_to_none=True)
            stats, routed = jagg.paper_gradients(  # adds the minibatch's gradient to .grad
                make_velocity_fn(model, c[idx]), traj.subset(idx), adv[idx], cfg, WINDOW,
                ref_fn=make_velocity_fn(ref, c[idx]))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        print(f"epoch {epoch:2d}  reward {history[-1]:+.3f}  loss {stats['loss']:+.4f}  "
              f"kl {stats['kl']:.4f}")
    return history


if __name__ == "__main__":
    main()
