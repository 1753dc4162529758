"""What a long training run needs around JAGG's gradient that a two-minute demo does not.

train_sd.py uses all three modules; train_toy.py uses none; your own trainer may use grpo_step.
- grpo_step.py: the optimizer step of a real run, over micro-batches and ranks (DDP, FSDP2),
  a non-finite step skipped on every rank alike.
- run_folder.py: a run's folder: one run per folder, files written whole, signals that stop the
  run cleanly.
- checkpoint.py: a run's state saved whole (FSDP's shards gathered), read back safely, and
  resumed only as the run that saved it.
"""
