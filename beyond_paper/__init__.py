"""Everything beyond the paper, OURS: nothing here is needed to learn or run JAGG (jagg.py is the paper alone).

Each module does one job, imports jagg.py, and is imported by nothing in jagg.py:
- options.py: our options beyond the paper (shared anchors, rollout interiors, a memory bound,
  index weights, routing schedules, two experts), each off by default, and backward_batch, the
  loop that runs them: `from beyond_paper import options`.
- checks.py: the adopter's checks, once before training: your velocity_fn against jagg.py's
  contract and against your own pipeline's time convention.
- probe.py: JAGG's gradient against the exact one on your model, per window, in units of an
  optimizer step's own noise.
- ranks.py: JAGG's multi-GPU rule (docs/many_gpus.md): backward passes inside no_sync, one
  all-reduce per optimizer step, decisions taken alike on every rank.
"""
