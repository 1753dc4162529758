"""What FSDP saves per rank, measured: weights, gradients and optimizer state per rank, and each
mode's activations saved for backward, for one training step of the reduced SD3 transformer.

    for n in 1 2 4; do torchrun --standalone --nproc_per_node=$n lab/fsdp_memory.py --out runs/fsdp_memory; done
    python lab/fsdp_memory.py --report runs/fsdp_memory      # the table in lab/reports/benchmarks.md

    torchrun --standalone --nproc_per_node=8 lab/fsdp_memory.py --size sd35-medium --out runs/fsdp_gpu   # GPUs

Every weight is trained (full fine-tuning, AdamW), sharded with lab/sd_runner.py's shard_transformer.
On GPUs each rank takes its own (LOCAL_RANK) and the peak memory per mode is recorded too.
The state figures are the bytes this rank holds (its shards); the activations are
bench.saved_bytes_peak's (bytes saved for backward at the step's peak, weights left out),
per mode, one step of T = 10 (the first 9 trained), W = 4, B = 2 samples per rank, CFG and no KL.
"""

import argparse
import glob
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jagg  # noqa: E402
from beyond_paper import options  # noqa: E402
import grpo_step  # noqa: E402
from bench import TRAINING_MODES, mode_settings, saved_bytes_peak  # noqa: E402
from grpo_step import init_distributed  # noqa: E402
from run_folder import write_json  # noqa: E402
from sd_benchmark import SD3_CONFIGS  # noqa: E402


def local_bytes(tensors):
    """Bytes this rank holds of tensors (a DTensor's local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def measure(args):
    import sd_runner
    from diffusers import SD3Transformer2DModel

    rank, world = init_distributed(always=True)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_default_device(device)
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(**SD3_CONFIGS[args.size])
    sd_runner.shard_transformer(transformer)
    params = list(transformer.parameters())
    tc, B, T, W = transformer.config, 2, 10, 4
    cond = (torch.randn(B, 77, tc.joint_attention_dim), torch.randn(B, tc.pooled_projection_dim))
    uncond = (torch.zeros_like(cond[0]), torch.zeros_like(cond[1]))
    velocity_fn = sd_runner.make_velocity_fn(transformer, cond, uncond, 4.5, use_bf16=False)
    g = torch.Generator(device=device).manual_seed(rank)
    traj = jagg.rollout(velocity_fn, torch.randn(B, tc.in_channels, tc.sample_size, tc.sample_size, generator=g),
                        jagg.sigma_schedule(T), 0.7, generator=g).first_steps(9)
    adv, cfg = torch.randn(B, generator=g), jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    saved, peak = {}, {}
    for name in TRAINING_MODES:
        anchors, interior, rows = mode_settings(name)
        opts = options.JaggOptions(W, 0.0 if name == "exact" else 1.0, anchors=anchors, interior=interior,
                                        max_graph_rows=rows)
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        saved[name] = saved_bytes_peak(lambda: options.backward_batch(velocity_fn, traj, adv, cfg, opts))
        if device.type == "cuda":  # what the GPU held at the peak, weights and all
            peak[name] = torch.cuda.max_memory_allocated(device)
    grads = local_bytes([p.grad for p in params if p.grad is not None])
    optimizer.step()  # creates AdamW's two moments, sharded like the weights
    state = local_bytes([v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()])
    result = {"ranks": world, "rank": rank, "size": args.size, "params": sum(p.numel() for p in params),
              "param_bytes": local_bytes(params), "grad_bytes": grads, "optimizer_bytes": state, "saved_bytes": saved,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "peak_bytes": peak}
    if rank == 0:
        write_json(os.path.join(args.out, f"ranks{world}.json"), result)
        print(json.dumps(result))


def report(folder):
    runs = sorted((json.load(open(f)) for f in glob.glob(os.path.join(folder, "ranks*.json"))), key=lambda r: r["ranks"])
    mib = 2**20
    print(f"SD3 transformer '{runs[0]['size']}', {runs[0]['params'] / 1e6:.1f}M parameters, all trained, AdamW, on "
          f"{runs[0].get('device', 'cpu')}; per rank, MiB")
    print()
    print("| ranks | weights | gradients | optimizer state | activations saved: " + " | ".join(runs[0]["saved_bytes"]) + " |")
    print("|---" * (4 + len(runs[0]["saved_bytes"])) + "|")
    for r in runs:
        print(f"| {r['ranks']} | {r['param_bytes'] / mib:.1f} | {r['grad_bytes'] / mib:.1f} | {r['optimizer_bytes'] / mib:.1f} | "
              + " | ".join(f"{v / mib:.1f}" for v in r["saved_bytes"].values()) + " |")
    if runs[0].get("peak_bytes"):  # GPUs: the peak allocated per mode, weights, gradients and all
        print("\nGPU peak per rank, GiB: " + "; ".join(
            f"{r['ranks']} ranks: " + ", ".join(f"{m} {v / 2**30:.1f}" for m, v in r["peak_bytes"].items()) for r in runs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/fsdp_memory", help="folder of the ranks<N>.json files")
    parser.add_argument("--size", default="cpu", choices=["cpu", "tiny", "sd35-medium"],
                        help="the transformer's configuration (random weights): the reduced cpu or tiny one, or "
                             "SD3.5-medium's (on GPUs)")
    parser.add_argument("--report", default="", help="print the table of a folder's runs instead of measuring")
    args = parser.parse_args()
    if args.report:
        return report(args.report)
    measure(args)


if __name__ == "__main__":
    main()
    grpo_step.exit_distributed()  # a rank under torchrun leaves here, skipping a shutdown that can abort
