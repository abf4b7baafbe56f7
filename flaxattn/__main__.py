"""`python -m flaxattn`: a short tour on this machine.

Builds a GQA `flaxattn.MultiHeadAttention` with RoPE, runs it forward and backward on a
packed row of documents, prints which kernel served the call and how far the fused kernel
is from the dense reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flaxattn


def main():
  b, t, features, heads, kv_heads = 2, 1024, 256, 8, 2
  # Four documents of uneven length per row, then padding (segment 0).
  lengths = [300, 17, 500, 150]
  seg = np.zeros((b, t), np.int32)
  pos = np.zeros((b, t), np.int32)
  start = 0
  for doc, n in enumerate(lengths, 1):
    seg[:, start:start + n], pos[:, start:start + n] = doc, np.arange(n)
    start += n
  x = jax.random.normal(jax.random.key(0), (b, t, features))

  def make(backend):
    return flaxattn.MultiHeadAttention(heads, features, num_kv_heads=kv_heads, backend=backend,
                                       mask=flaxattn.Causal(), rope=flaxattn.RoPE(),
                                       rngs=nnx.Rngs(0))

  @nnx.jit
  def loss_and_grad(layer):
    def loss(layer):
      return jnp.mean(layer(x, segment_ids=seg, positions=pos) ** 2)
    return nnx.value_and_grad(loss)(layer)

  q = jax.ShapeDtypeStruct((b, t, heads, features // heads), jnp.float32)
  k = jax.ShapeDtypeStruct((b, t, kv_heads, features // heads), jnp.float32)
  flaxattn.explain(q, k, k, segment_ids=seg, positions=pos)
  (fused_loss, fused_grad), (ref_loss, ref_grad) = (loss_and_grad(make(n))
                                                    for n in ("auto", "reference"))
  err = max(float(jnp.abs(a - b).max())
            for a, b in zip(jax.tree.leaves(fused_grad), jax.tree.leaves(ref_grad), strict=True))
  print(f"\nlayer loss: auto {float(fused_loss):.6f}, reference {float(ref_loss):.6f};"
        f" max |grad difference| {err:.2e}")
  desc = flaxattn.seqlens_and_offsets(seg, max_segments=8)
  print(f"THD descriptor of row 0: seqlens {desc.q_seqlens[0].tolist()},"
        f" offsets {desc.q_offsets[0].tolist()}")


if __name__ == "__main__":
  main()
