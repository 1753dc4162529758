"""Step 2 of the README's "Use it on your model", on SD3: check a velocity_fn against its own
pipeline before training with it.

    python examples/check_sd3.py --model PATH                     # an SD3 / SD3.5 pipeline folder
    python examples/check_sd3.py --model PATH --time-input sigma  # what a wrong time input gives

Two checks, each a ValueError that names the problem. checks.check_velocity_fn: the shape,
determinism and the step-major repeat of the conditioning. checks.check_against_pipeline:
velocity_fn rolled out without noise must end where StableDiffusion3Pipeline ends for the same
noise, prompt embeddings and guidance; a wrong time convention (sigma where SD3 takes sigma * 1000,
the time reversed, another shift) trains without any error, and only this check names it. For
another family, put its velocity_fn (examples/diffusers_models.py) and its pipeline call here.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from beyond_paper import checks  # noqa: E402
import train_sd  # noqa: E402  (its SD3 velocity_fn and text encoding)
from diffusers_models import scheduler_sigmas  # noqa: E402  (this folder's recipes)

PROMPTS = ["a photo of a cat sitting on a windowsill", "a lighthouse on a cliff at sunset"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a StableDiffusion3Pipeline folder or hub id")
    parser.add_argument("--num-steps", type=int, default=10, help="T, sampling steps")
    parser.add_argument("--guidance-scale", type=float, default=4.5, help="CFG scale")
    parser.add_argument("--time-input", choices=["sigma*1000", "sigma", "1-sigma"],
                        default="sigma*1000",
                        help="what the transformer is given as its timestep: SD3's is "
                             "sigma*1000; the others show what the check says of a wrong "
                             "convention")
    args = parser.parse_args(argv)
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer.eval()
    resolution = min(512, transformer.config.sample_size * pipe.vae_scale_factor)  # train_sd.py's default
    h = resolution // pipe.vae_scale_factor
    cond, uncond = train_sd.encode(pipe, PROMPTS, "cpu")  # each (prompt_embeds, pooled)
    noise = torch.randn(len(PROMPTS), transformer.config.in_channels, h, h,
                        generator=torch.Generator().manual_seed(0))  # [B, C, h, w]
    fn = train_sd.make_velocity_fn(transformer, cond, uncond, args.guidance_scale, use_bf16=False)
    wrong = {"sigma*1000": lambda t: t, "sigma": lambda t: t / 1000, "1-sigma": lambda t: 1 - t}
    time_input = wrong[args.time_input]  # make_velocity_fn passes t * 1000: undone or reversed here

    def velocity_fn(z, t):  # [S, B, C, h, w], [S, B] -> [S, B, C, h, w]
        return fn(z, time_input(t))

    sigmas = scheduler_sigmas(pipe.scheduler, args.num_steps)  # [T + 1], the scheduler's own
    with torch.no_grad():
        checks.check_velocity_fn(velocity_fn, noise, sigmas)
        print("check_velocity_fn: passed (shape, determinism, conditioning repeated step-major)")
        latents = pipe(prompt_embeds=cond[0], pooled_prompt_embeds=cond[1],
                       negative_prompt_embeds=uncond[0], negative_pooled_prompt_embeds=uncond[1],
                       latents=noise.clone(), height=resolution, width=resolution,
                       num_inference_steps=args.num_steps, guidance_scale=args.guidance_scale,
                       output_type="latent").images  # [B, C, h, w]
        try:
            error = checks.check_against_pipeline(velocity_fn, noise, sigmas, latents)
        except ValueError as e:
            raise SystemExit(f"check_against_pipeline: {e}") from None
    print(f"check_against_pipeline: passed, relative difference {error:.1e} from the pipeline's "
          "latents")


if __name__ == "__main__":
    main()
