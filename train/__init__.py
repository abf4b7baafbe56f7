"""The trainer: `python -m train CONFIG.yaml [key=value ...]`.

Modules, one per concept: `config` (the schema, YAML and overrides), `run_dir` (what a
run keeps there; which config changes a resume refuses; starting over), `distributed`
(platform, simulated devices, multi-host init, agreement between processes), `mesh`,
`tokenizer`, `data` (corpus checks, grain pipeline and global batches), `optimizer`,
`checkpoint` (orbax; damaged versus unusable), `state` (the model and optimizer, and
where a run starts), `metrics` (JSONL, TensorBoard, loss plot), `throughput` (model FLOPs
of a batch, MFU), `stop` (SIGTERM and SIGINT) and `loop` (`run`: setup, restore, the training loop).
Nothing is imported here, so `python -m train` can set up devices before jax starts.
"""
