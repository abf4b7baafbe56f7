"""Programmable masks (`flaxattn.MaskMod`): their cost against the built-ins, the block map's
build time, and PyTorch's FlexAttention on the same patterns, on this host's CPU.

  python -m bench.masks [--json bench/results/masks_cpu.json] [--repeats 3]
      [--lengths 4096 8192 16384] [--build-lengths 32768 131072] [--no-torch]
      [--pictures docs/masks]

B=1, H=8 query heads, Hkv=8, D=64, float32 on a CPU (bfloat16 on a GPU); forward+backward
is the gradient of sum(out^2) w.r.t. q, k, v; flaxattn runs `backend="auto"` (blockwise
on a CPU). Times are the best of `--repeats` after a warm-up (compiling excluded), the
cases of a comparison timed in alternation, so that load from other work on a shared host
falls on both. On a GPU host (bench/gpu_check.sh) the same run measures the GPU, and
FlexAttention runs on CUDA with its backward where torch has it.

1. Ratios (T=4096): `MaskMod(lambda b, h, q, k: k <= q)` against `Causal()`; a document
   mask given as an operand (`docs[b, q] == docs[b, k]`, causal; 16 documents) against the
   same documents as segment ids with `Causal()`. Goals: at most 1.25 and 1.5.
2. Four patterns (causal, sliding window of 1024, prefix-LM with a prefix of T/4, document
   mask of 16 documents) at each of `--lengths`: flaxattn's block map alone
   (`flaxattn.blocks.block_map`, jitted), its forward and its forward+backward; with torch
   installed (the `flex` extra), `torch.nn.attention.flex_attention.create_block_mask`
   alone and `torch.compile(flex_attention)`'s forward on the same shapes and masks (its
   default 128 x 128 blocks; flaxattn's blockwise 512 x 512), and on a GPU its
   forward+backward. FlexAttention has no backward on a CPU (torch 2.13: "FlexAttention
   does not support backward on CPU"), so the two compare by forward there.
3. The block map's build time alone at `--build-lengths` with 64 documents: flaxattn with
   the documents as segment ids and a causal `MaskMod` (blocks across documents are never
   evaluated) and as an operand (every block is); torch's `create_block_mask` of the
   document mask_mod.
`--pictures DIR`: PNGs of each pattern's block map at T=4096 in 256-token blocks (the
pictures of docs/masks.md).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import flaxattn
from flaxattn import MaskMod, blocks

B, H, D = 1, 8, 64
DOCS, BUILD_DOCS, WINDOW = 16, 64, 1024
GPU = jax.default_backend() == "gpu"
DTYPE = jnp.bfloat16 if GPU else jnp.float32


def _docs(t: int, n: int) -> np.ndarray:
  """Document ids `[1, t]` of n equal documents, 1..n."""
  return np.repeat(np.arange(1, n + 1, dtype=np.int32), t // n)[None]


def patterns(t: int) -> dict:
  """name -> (flaxattn mask, flaxattn segment ids or None, torch mask_mod or None)."""
  docs = _docs(t, DOCS)
  prefix = t // 4
  return {
      "causal": (MaskMod(lambda b, h, q, k: k <= q), None,
                 lambda b, h, q, k: k <= q),
      "sliding window": (MaskMod(lambda b, h, q, k: (k <= q) & (q - k < WINDOW)), None,
                         lambda b, h, q, k: (k <= q) & (q - k < WINDOW)),
      "prefix-LM": (MaskMod(lambda b, h, q, k, p: (k <= q) | (k < p[b]),
                            jnp.full((B,), prefix, jnp.int32)), None,
                    lambda b, h, q, k: (k <= q) | (k < prefix)),
      "document": (MaskMod(lambda b, h, q, k, d: (d[b, q] == d[b, k]) & (k <= q),
                           jnp.asarray(docs)), None, _torch_document(docs)),
  }


def _torch_document(docs):
  ids = {}

  def mask_mod(b, h, q, k):
    import torch
    if q.device not in ids:  # the ids on the device the block mask is built on, once
      ids[q.device] = torch.as_tensor(docs, device=q.device)
    return (ids[q.device][b, q] == ids[q.device][b, k]) & (k <= q)
  return mask_mod


def best(fns: dict, repeats: int) -> dict:
  """name -> best seconds of `repeats` calls of each fn (one warm-up call first), the fns
  called in alternation."""
  for fn in fns.values():
    fn()
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  return {name: min(ts) for name, ts in times.items()}


def _inputs(t: int):
  keys = jax.random.split(jax.random.key(t), 3)
  return tuple(jax.random.normal(k, (B, t, H, D), DTYPE) for k in keys)


def _fwd_bwd(mask, seg, t, backward: bool = True):
  """A jitted forward+backward (or forward) of flaxattn with `mask` (and segment ids
  `seg`)."""
  q, k, v = _inputs(t)
  seg = None if seg is None else jnp.asarray(seg)

  def loss(q, k, v):
    out = flaxattn.attention(q, k, v, mask=mask, segment_ids=seg).astype(jnp.float32)
    return jnp.sum(out * out)
  step = jax.jit(jax.grad(loss, (0, 1, 2)) if backward else loss)
  return lambda: jax.block_until_ready(step(q, k, v))


def _build(mask, seg, t):
  """A jitted block map of `mask` at T = t (blockwise's blocks)."""
  seg = None if seg is None else jnp.asarray(seg)
  build = jax.jit(lambda mask, seg: blocks.block_map(mask, t, segment_ids=seg, batch=B,
                                                     heads=H))
  return lambda: jax.block_until_ready(build(mask, seg))


def ratios(repeats: int) -> dict:
  t = 4096
  docs = _docs(t, DOCS)
  causal = best({"MaskMod(k <= q)": _fwd_bwd(MaskMod(lambda b, h, q, k: k <= q), None, t),
                 "Causal()": _fwd_bwd(flaxattn.Causal(), None, t)}, repeats)
  operand = MaskMod(lambda b, h, q, k, d: (d[b, q] == d[b, k]) & (k <= q), jnp.asarray(docs))
  document = best({"documents as an operand": _fwd_bwd(operand, None, t),
                   "segment ids + Causal()": _fwd_bwd(flaxattn.Causal(), docs, t)}, repeats)
  return {"T": t, "causal": causal,
          "causal_ratio": causal["MaskMod(k <= q)"] / causal["Causal()"],
          "document": document,
          "document_ratio": (document["documents as an operand"]
                             / document["segment ids + Causal()"])}


def _torch():
  try:
    import torch
    from torch.nn.attention import flex_attention as flex
  except ImportError:
    return None
  return torch, flex


def _torch_device(torch) -> str:
  return "cuda" if GPU and torch.cuda.is_available() else "cpu"


def _torch_cases(torch_mods, mask_mod, t):
  """Timers of FlexAttention for `mask_mod` at T = t: its block mask's build, its forward
  and, on a GPU, its forward+backward."""
  torch, flex = torch_mods
  device = _torch_device(torch)
  build = lambda: flex.create_block_mask(mask_mod, B, H, t, t, device=device)  # noqa: E731
  block_mask = build()
  compiled = torch.compile(flex.flex_attention)
  dtype = torch.bfloat16 if device == "cuda" else torch.float32
  q, k, v = (torch.randn(B, H, t, D, device=device, dtype=dtype,
                         requires_grad=device == "cuda") for _ in range(3))

  def sync():
    if device == "cuda":
      torch.cuda.synchronize()

  def forward():
    with torch.no_grad():
      out = compiled(q, k, v, block_mask=block_mask)
      sync()
      return out

  def forward_backward():
    out = compiled(q, k, v, block_mask=block_mask).float()
    (out * out).sum().backward()
    sync()

  timers = {"flex build": lambda: (build(), sync()), "flex forward": forward}
  if device == "cuda":  # no backward on a CPU
    timers["flex f+b"] = forward_backward
  return timers


def by_pattern(lengths, repeats: int, use_torch: bool) -> list[dict]:
  torch_mods = _torch() if use_torch else None
  rows = []
  for t in lengths:
    for name, (mask, seg, mask_mod) in patterns(t).items():
      fns = {"flaxattn build": _build(mask, seg, t),
             "flaxattn forward": _fwd_bwd(mask, seg, t, backward=False),
             "flaxattn f+b": _fwd_bwd(mask, seg, t)}
      if torch_mods is not None:
        fns |= _torch_cases(torch_mods, mask_mod, t)
      times = best(fns, repeats)
      counts = blocks.counts(jax.jit(lambda m, t=t: blocks.block_map(m, t, batch=B))(mask))
      rows.append({"pattern": name, "T": t, "blocks": counts, **times})
      print(json.dumps(rows[-1]), flush=True)
  return rows


def build_only(lengths, repeats: int, use_torch: bool) -> list[dict]:
  torch_mods = _torch() if use_torch else None
  rows = []
  causal = MaskMod(lambda b, h, q, k: k <= q)
  for t in lengths:
    docs = _docs(t, BUILD_DOCS)
    operand = MaskMod(lambda b, h, q, k, d: (d[b, q] == d[b, k]) & (k <= q), jnp.asarray(docs))
    fns = {"flaxattn, segment ids": _build(causal, docs, t),
           "flaxattn, operand": _build(operand, None, t)}
    if torch_mods is not None:
      mask_mod = _torch_document(docs)
      fns["flex create_block_mask"] = lambda m=mask_mod, t=t: torch_mods[1].create_block_mask(
          m, B, H, t, t, device=_torch_device(torch_mods[0]))
    rows.append({"T": t, "documents": BUILD_DOCS, **best(fns, repeats)})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def pictures(directory: str) -> None:
  """PNGs of the block maps of docs/masks.md's masks at T=4096 in 256-token blocks."""
  import os
  os.makedirs(directory, exist_ok=True)
  t = 4096
  masks = {name: (mask, seg) for name, (mask, seg, _) in patterns(t).items()}
  masks["dilated window"] = (MaskMod(lambda b, h, q, k: (k <= q) & (q - k < WINDOW)
                                     & ((q - k) % 2 == 0)), None)
  masks["per-head window"] = (MaskMod(lambda b, h, q, k, w: (k <= q) & (q - k < w[h]),
                                      jnp.array([256, 512, 1024, 4096])), None)
  masks["local or prefix"] = (flaxattn.Local(512) | MaskMod(
      lambda b, h, q, k, p: k < p[b], jnp.full((B,), t // 4, jnp.int32)), None)
  masks["documents as segment ids"] = (MaskMod(lambda b, h, q, k: k <= q), _docs(t, DOCS))
  for name, (mask, seg) in masks.items():
    kinds = blocks.block_map(mask, t, segment_ids=seg, heads=4, block_q=256, block_kv=256)
    c = blocks.counts(kinds)
    blocks.draw(kinds, os.path.join(directory, name.replace(" ", "_").lower() + ".png"),
                title=f"{name}, T={t}, 256-token blocks\n{c['empty']} empty, {c['partial']}"
                f" partial, {c['full']} full")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384])
  parser.add_argument("--build-lengths", type=int, nargs="*", default=[32768, 131072])
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument("--pictures")
  args = parser.parse_args(argv)
  if args.pictures:
    pictures(args.pictures)
  result = {"host": {"jax": jax.__version__, "devices": str(jax.devices())}}
  torch_mods = None if args.no_torch else _torch()
  if torch_mods is not None:
    result["host"]["torch"] = torch_mods[0].__version__
  result["ratios"] = ratios(args.repeats)
  print(json.dumps(result["ratios"]), flush=True)
  result["patterns"] = by_pattern(args.lengths, args.repeats, not args.no_torch)
  result["build"] = build_only(args.build_lengths, args.repeats, not args.no_torch)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
