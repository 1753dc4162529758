"""Every training mode of the SD3 transformer timed and weighed: the tables of lab/reports/benchmarks.md and
lab/reports/sde_window.md, and the command that times JAGG against exact on your GPU.

    python lab/sd_benchmark.py --window 4                                   # the reduced SD3 on a CPU
    python lab/sd_benchmark.py --size sd35-medium --resolution 512 --window 4 --max-graph-rows 2   # on a GPU
    python lab/sd_benchmark.py --train lora --lora-rank 32 --batch 9 --checkpointing   # the user's setting
    python lab/sd_benchmark.py --model DIR ...                              # a saved pipeline's transformer

One window's gradient on the conditional branch (the backward JAGG shrinks), then one whole training step
in every mode as lab/sd_runner.py runs it: the trained steps of --num-steps (Flow-GRPO's 9 of 10), CFG with the
no-graph unconditional branch, the KL reference at --beta, and one rollout of the batch; then each SDE
window (lab/reports/sde_window.md). Interleaved, medians of repeats; activations saved for backward
weighed (bench.saved_bytes_peak); benchmark.json and benchmark.png in --out.
"""

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jagg  # noqa: E402
import sd_runner  # noqa: E402
import run_folder  # noqa: E402
from bench import bench_modes, benchmark_trajectory, benchmark_window, report_benchmark, report_trajectory  # noqa: E402
from charts import save_png, training_step_bars  # noqa: E402


@dataclasses.dataclass
class BenchConfig:
    """The benchmark's settings; --help lists them as flags."""
    model: str = ""  # a saved pipeline's folder (its transformer, random weights); empty: --size
    size: str = "auto"  # sd35-medium, cpu (7.8M parameters), tiny; auto: sd35-medium on a GPU, cpu on a CPU
    device: str = "auto"  # cuda, cpu or auto
    mixed_precision: str = "auto"  # bf16 autocast, fp32, or auto (bf16 on a GPU)
    resolution: int = 0  # pixels for sd35-medium or --model (0: 512); the reduced sizes use their own
    window: int = 4
    num_steps: int = 10
    timestep_fraction: float = 0.99
    sigma_schedule: str = "scheduler"
    guidance_scale: float = 4.5
    noise_level: float = 0.7
    clip_range: float = 1e-4
    beta: float = 0.04
    max_graph_rows: int = 0  # > 0: every JAGG mode the bound changes, again with it
    batch: int = 0  # B; 0: 4 on a GPU, 2 on a CPU
    train: str = "full"  # full: every weight; lora: a LoRA of --lora-rank on the attention projections
    lora_rank: int = 32
    checkpointing: bool = False  # gradient checkpointing (lab/sd_runner.py's default); the backward recomputes
    repeats: int = 5
    sde_windows: str = "3,4"  # the SDE windows' sizes K, each trained exactly and with JAGG at min(K, --window)
    json: bool = False  # print one JSON object instead of the tables
    seed: int = 0
    out: str = "runs/sd_bench"

    def trained_steps(self):
        return int(self.num_steps * self.timestep_fraction)


# Transformers without weights (the timing does not depend on them): SD3.5-medium's on a GPU, on a CPU a
# reduced one of its kind that 2 cores time in minutes.
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
SD3_CONFIGS = {
    "sd35-medium": SD35_MEDIUM,  # SD3.5-medium's transformer (MMDiT-X, 2.24B parameters)
    "cpu": dict(SD35_MEDIUM, sample_size=32, num_layers=6, attention_head_dim=32, num_attention_heads=6,
                joint_attention_dim=192, caption_projection_dim=192, pooled_projection_dim=192,
                pos_embed_max_size=32, dual_attention_layers=(), qk_norm=None),  # 7.8M parameters
    # For tests only.
    "tiny": dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                 pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8),
}


def benchmark(cfg):
    """One window's gradient on the conditional branch alone (the backward JAGG shrinks, as
    before), then one whole trajectory's training computation in every mode, as train() runs it:
    the trained steps of --num-steps (--timestep-fraction, Flow-GRPO's 9 of 10 by default),
    classifier-free guidance with the no-graph unconditional branch, the KL reference at --beta,
    and one rollout of the same batch. Interleaved, medians of repeats."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    use_bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and device.type == "cuda")
    torch.manual_seed(cfg.seed)
    size = cfg.model or (cfg.size if cfg.size != "auto" else ("sd35-medium" if device.type == "cuda" else "cpu"))
    config = SD3_CONFIGS.get(size) or SD3Transformer2DModel.load_config(os.path.expanduser(cfg.model),
                                                                        subfolder="transformer")
    with torch.device(device):  # initialised where it runs: SD3.5-medium's 2.24B parameters take seconds on a GPU
        transformer = SD3Transformer2DModel.from_config(config)
    transformer.to(device, torch.bfloat16 if use_bf16 else torch.float32)
    if cfg.train == "lora":
        sd_runner.add_lora(transformer, cfg.lora_rank)
        transformer.to(device)
    params = [p for p in transformer.parameters() if p.requires_grad]  # every weight, or the LoRA's
    if cfg.checkpointing:
        transformer.enable_gradient_checkpointing()
    tc = transformer.config
    B = cfg.batch or (4 if device.type == "cuda" else 2)
    W, T, L = cfg.window, cfg.num_steps, 77
    # The reduced configurations at their own size; SD3.5-medium or a real model at --resolution.
    h = tc.sample_size if size in ("cpu", "tiny") else (cfg.resolution or 512) // 8  # latent side
    cond = (torch.randn(B, L, tc.joint_attention_dim, device=device), torch.randn(B, tc.pooled_projection_dim, device=device))
    uncond = (torch.randn(B, L, tc.joint_attention_dim, device=device), torch.randn(B, tc.pooled_projection_dim, device=device))
    velocity_fn = sd_runner.make_velocity_fn(transformer, cond, uncond, cfg.guidance_scale, use_bf16)  # CFG, as training runs it
    cond_only = sd_runner.make_velocity_fn(transformer, cond, None, 1.0, use_bf16)  # the window-level rows: what JAGG shrinks
    # The KL reference: the transformer itself (backward_batch calls it without grad), which costs
    # what the adapter-disabled LoRA model or a frozen copy costs.
    ref_fn = velocity_fn if cfg.beta > 0 else None
    sigmas = sd_runner.sampling_sigmas(cfg, FlowMatchEulerDiscreteScheduler(shift=3.0)).to(device)  # [T+1]
    noise = torch.randn(B, tc.in_channels, h, h, device=device)  # [B, C, h, w]
    traj = jagg.rollout(velocity_fn, noise, sigmas, cfg.noise_level)
    adv = torch.randn(B, device=device)  # [B]
    loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
    window_loss = jagg.make_step_loss(traj, adv, 0, W, jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range))

    def measure():
        t_window = benchmark_window(cond_only, params, traj.z[:W], traj.t[:W], window_loss, repeats=cfg.repeats)
        t_traj = benchmark_trajectory(velocity_fn, params, traj.first_steps(cfg.trained_steps()), adv, loss_cfg, W, ref_fn,
                                      repeats=cfg.repeats,
                                           modes=bench_modes(cfg.max_graph_rows),
                                           rollout_fn=lambda: jagg.rollout(velocity_fn, noise, sigmas, cfg.noise_level))
        # JAGG or an SDE window: a window of K steps trained exactly, and with JAGG inside it at W = min(K, --window)
        # (the paper's, and the fast mode, bounded too with --max-graph-rows). Its rollout calls the network at the
        # same T steps as a full one (the ODE steps too).
        sde_modes = ("exact", "jagg", "jagg_shared_rollout") + (
            (f"jagg_shared_rollout_rows{cfg.max_graph_rows}",) if cfg.max_graph_rows >= 2 else ())
        t_sde = {K: benchmark_trajectory(velocity_fn, params, traj.first_steps(K), adv, loss_cfg, min(K, W), ref_fn,
                                         repeats=cfg.repeats, modes=sde_modes)
                 for K in sde_windows(cfg) if K <= T}
        return t_window, t_traj, t_sde

    # No gradient checkpointing unless the largest joint anchor batch does not fit: the benchmark
    # times the plain forward and backward passes where it can.
    checkpointing = cfg.checkpointing
    try:
        t, t_traj, t_sde = measure()
    except torch.cuda.OutOfMemoryError:
        if device.type != "cuda" or checkpointing:
            raise
        checkpointing = True
        print("out of GPU memory without gradient checkpointing: timing every mode again with it")
        for p in params:
            p.grad = None
        torch.cuda.empty_cache()
        transformer.enable_gradient_checkpointing()
        t, t_traj, t_sde = measure()
    result = {
        "window": W, "trained_steps": cfg.trained_steps(), "params": sum(p.numel() for p in transformer.parameters()),
        "trained_params": sum(p.numel() for p in params), "train": cfg.train,
        "lora_rank": cfg.lora_rank if cfg.train == "lora" else None, "device": str(
            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "config": size, "batch": B, "tokens": (h // tc.patch_size) ** 2 + L, "bf16": use_bf16, "repeats": cfg.repeats,
        "gradient_checkpointing": checkpointing,
        "exact_backward_s": t["exact"]["backward"], "jagg_backward_s": t["jagg"]["backward"],
        "exact_fwd_graph_s": t["exact"]["fwd_graph"], "jagg_fwd_graph_s": t["jagg"]["fwd_graph"],
        "jagg_fwd_nograd_s": t["jagg"]["fwd_nograd"],
        "exact_step_s": t["exact"]["total"], "jagg_step_s": t["jagg"]["total"],
        "num_steps": T, "guidance_scale": cfg.guidance_scale, "beta": cfg.beta,
    }
    with contextlib.redirect_stdout(io.StringIO()) if cfg.json else contextlib.nullcontext():
        trained = "all trained" if cfg.train == "full" else \
            f"LoRA rank {cfg.lora_rank} trained: {result['trained_params'] / 1e6:.2f}M"
        print(f"SD3 transformer '{size}', {result['params'] / 1e6:.1f}M parameters ({trained}), {result['device']}, "
              f"B = {B}, {result['tokens']} tokens, bf16 {use_bf16}, gradient checkpointing {checkpointing}, "
              f"medians of {cfg.repeats} interleaved repeats")
        print(f"\n-- one window's gradient, conditional branch only (W = {W})")
        result.update(report_benchmark(t, W))
        print(f"\n-- one training step: a whole trajectory (T = {T}, the first {cfg.trained_steps()} trained, "
              f"CFG {cfg.guidance_scale}, beta {cfg.beta}, W = {W})")
        result.update(report_trajectory(t_traj, W))
        print(f"\n-- JAGG or an SDE window: a window of K steps trained (--sde-window K), exact and with JAGG at W = min(K, {W}); "
              f"its rollout takes the same T = {T} network calls")
        result["sde_windows"] = report_sde_windows(result, t_sde)
    run_folder.write_json(os.path.join(cfg.out, "benchmark.json"), {"config": dataclasses.asdict(cfg), "result": result})
    save_png(os.path.join(cfg.out, "benchmark.png"), training_step_bars(
        {W: result}, 1.0, "s", f"SD3 '{size}' on {result['device']}: one GRPO training step "
                               f"(T = {T}, CFG {cfg.guidance_scale}, beta {cfg.beta}, B = {B})"))
    if cfg.json:
        print(json.dumps(result))
    return result


def sde_windows(cfg):
    """The SDE windows' sizes of --sde-windows: by default Flow-GRPO-Fast's 3 (geneval) and MixGRPO's 4."""
    return [int(k) for k in cfg.sde_windows.split(",") if k.strip()]


def report_sde_windows(result, t_sde):
    """Print the full trajectory's modes beside each SDE window's, as one table of what an epoch
    costs: rows with grad, training step, epoch (rollout + step), activations saved for backward.
    Returns {"<setting>": {those}}."""
    rollout = result["rollout_s"]
    rows = {f"all {result['trained_steps']} steps, {m}": (result["backward_rows"][m], result["train_s"][m],
                                                          result["saved_gb"][m])
            for m in ("exact", "jagg", "jagg_shared_rollout") if m in result["train_s"]}
    peaks = {name: result["peak_mem_gb"][m] for name, m in zip(list(rows), [m for m in ("exact", "jagg", "jagg_shared_rollout")
                                                                             if m in result["train_s"]])
             if "peak_mem_gb" in result}  # on CUDA only
    for K, t in t_sde.items():
        rows.update({f"window of {K}, {m}": (int(t[m]["backward_rows"]), t[m]["train_s"], t[m]["saved_gb"]) for m in t})
        peaks.update({f"window of {K}, {m}": t[m]["peak_mem_gb"] for m in t if "peak_mem_gb" in t[m]})
    base = rows[f"all {result['trained_steps']} steps, exact"]
    print(f"{'setting':>36} {'rows':>5} {'step (s)':>9} {'x step':>7} {'epoch (s)':>10} {'x epoch':>8} {'saved MiB':>10}"
          + (f" {'peak GiB':>9}" if peaks else ""))
    out = {}
    for name, (n, step, saved) in rows.items():
        out[name] = {"rows": n, "train_s": step, "epoch_s": rollout + step, "saved_gb": saved}
        peak = ""
        if name in peaks:
            out[name]["peak_mem_gb"] = peaks[name]
            peak = f" {peaks[name]:>9.1f}"
        print(f"{name:>36} {n:>5} {step:>9.3f} {base[1] / step:>6.2f}x {rollout + step:>10.3f} "
              f"{(rollout + base[1]) / (rollout + step):>7.2f}x {1024 * saved:>10.1f}{peak}")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(BenchConfig):
        name = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(name, type={"int": int, "float": float, "str": str}.get(f.type, f.type), default=f.default)
    cfg = BenchConfig(**vars(parser.parse_args(argv)))
    if cfg.size not in ("auto", *SD3_CONFIGS) or cfg.train not in ("full", "lora") or cfg.window < 2:
        raise SystemExit(f"error: --size must be auto or one of {', '.join(SD3_CONFIGS)}, --train full or lora, "
                         f"--window >= 2; got {cfg.size!r}, {cfg.train!r}, {cfg.window}")
    return benchmark(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
