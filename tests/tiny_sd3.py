"""train_sd.py's tiny random SD3.5 (--model tiny) saved as a pipeline folder, for the tests that load one
from disk (examples/check_sd3.py, the lab's runner). Its images mean nothing: the tests check contracts."""

import torch

import train_sd


def build(folder, seed=0):
    """train_sd.tiny_pipeline(), its weights drawn from seed, saved with save_pretrained into folder."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        train_sd.tiny_pipeline().save_pretrained(str(folder))
    return str(folder)
