"""The trainer: `python -m train CONFIG.yaml [key=value ...]`.

Modules, one per concept: `config` (the schema, YAML and overrides), `distributed`
(platform, simulated devices, multi-host init), `mesh`, `tokenizer`, `data` (grain
pipeline and global batches), `optimizer`, `checkpoint` (orbax), `metrics` (JSONL,
TensorBoard, loss plot) and `loop` (the training loop). Nothing is imported here, so
`python -m train` can set up devices before jax starts.
"""
