"""flaxattn.sharding rules, and the layer on 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import helpers
from flaxattn import sharding
from flaxattn.layer import MultiHeadAttention
from flaxattn.rope import RoPE


def _mesh(**axes):
  return AbstractMesh(tuple(axes.values()), tuple(axes))


def test_rules_drop_absent_axes_and_non_dividing_ones():
  table = dict(sharding.rules(_mesh(data=2, tensor=4), kv_heads=2))
  assert table["batch"] == "data" and table["embed"] is None and table["seq"] is None
  assert table["heads"] == "tensor" and table["kv_heads"] is None and table["head_dim"] is None
  table = dict(sharding.rules(_mesh(data=2, fsdp=2, tensor=2, context=2), kv_heads=2))
  assert table["batch"] == ("data", "fsdp") and table["embed"] == "fsdp"
  assert table["seq"] == "context" and table["kv_heads"] == "tensor"


def test_rules_errors():
  with pytest.raises(ValueError, match=r"logical name .* got 'kv_head'"):
    sharding.rules(_mesh(tensor=4), kv_head=2)
  with pytest.raises(ValueError, match=r"kv_heads=.*positive int size, got 0"):
    sharding.rules(_mesh(tensor=4), kv_heads=0)


def test_logical_to_spec_uses_each_mesh_axis_once_and_checks_divisibility():
  mesh = _mesh(data=2, fsdp=2, tensor=4, context=2)
  # batch takes fsdp, so embed (also fsdp) stays replicated in the same array.
  assert sharding.logical_to_spec(("batch", "seq", "embed"), mesh=mesh) == (
      P(("data", "fsdp"), "context", None))
  assert sharding.logical_to_spec(("batch", "seq", "kv_heads", "head_dim"), (2, 1, 2, 8),
                                  mesh=mesh) == P("data", None, None, None)
  assert sharding.logical_to_spec(("embed", None), mesh=_mesh(data=2)) == P(None, None)


def test_constrain_is_a_no_op_without_mesh_or_rules():
  x = jnp.ones((2, 4, 8))
  assert sharding.constrain(x, ("batch", "seq", "embed")) is x
  with nnx.logical_axis_rules(sharding.DEFAULT_RULES):
    assert sharding.constrain(x, ("batch", "seq", "embed")) is x
  with pytest.raises(ValueError, match="one logical name per axis"):
    sharding.constrain(x, ("batch", "seq"))


@pytest.fixture(scope="module")
def eight_devices():
  """The layer under the default rules on 2-D meshes of 8 devices (parameter and output
  specs, error against one device), one entry per mesh."""
  b, t, e, h = 4, 16, 32, 8
  x = jax.random.normal(jax.random.key(1), (b, t, e))
  seg = jnp.array([[1] * 6 + [2] * 9 + [0]] * b, jnp.int32)
  pos = jnp.array([list(range(6)) + list(range(9)) + [0]] * b, jnp.int32)

  def make(num_kv_heads):
    return MultiHeadAttention(h, e, num_kv_heads=num_kv_heads, rope=RoPE(), backend="reference",
                              rngs=nnx.Rngs(0))

  def spec(a):
    return list(a.sharding.spec) + [None] * (a.ndim - len(a.sharding.spec))

  result = {}
  for name, axes, kv in [("data_tensor", dict(data=2, tensor=4), None),
                         ("data_tensor_gqa", dict(data=2, tensor=4), 2),
                         ("fsdp_tensor", dict(fsdp=2, tensor=4), None),
                         ("data_context", dict(data=2, context=4), 2)]:
    want = make(kv)(x, segment_ids=seg, positions=pos)
    mesh = helpers.mesh(axes)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules(mesh, kv_heads=kv or h)):
      m = nnx.jit(lambda: make(kv))()  # noqa: B023 (called right here)
      x_spec = sharding.logical_to_spec(("batch", "seq", "embed"), x.shape)
      xs = jax.device_put(x, NamedSharding(mesh, x_spec))
      got = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p))(m, xs, seg, pos)
    result[name] = dict(
        params={k: spec(v) for k, v in [("query", m.query.kernel[...]), ("key", m.key.kernel[...]),
                                        ("key_bias", m.key.bias[...]), ("out", m.out.kernel[...])]},
        out=spec(got), err=float(jnp.abs(got - want).max()))
  return result


@pytest.mark.slow  # the eight_devices fixture builds and runs every case
def test_param_specs_under_default_rules(eight_devices):
  r = eight_devices
  assert r["data_tensor"]["params"] == dict(
      query=[None, "tensor", None], key=[None, "tensor", None], key_bias=["tensor", None],
      out=["tensor", None, None])
  assert r["fsdp_tensor"]["params"] == dict(
      query=["fsdp", "tensor", None], key=["fsdp", "tensor", None], key_bias=["tensor", None],
      out=["tensor", None, "fsdp"])
  assert r["data_context"]["params"]["query"] == [None, None, None]


def test_gqa_with_fewer_kv_heads_than_tensor_axis(eight_devices):
  params = eight_devices["data_tensor_gqa"]["params"]
  assert params["query"] == [None, "tensor", None] and params["out"] == ["tensor", None, None]
  assert params["key"] == [None, None, None] and params["key_bias"] == [None, None]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["data_tensor", "data_tensor_gqa", "fsdp_tensor", "data_context"])
def test_sharded_forward_matches_single_device(eight_devices, name):
  r = eight_devices[name]
  assert r["err"] < 1e-5
  batch_axis = {"data_tensor": "data", "data_tensor_gqa": "data", "fsdp_tensor": "fsdp",
                "data_context": "data"}[name]
  seq_axis = "context" if name == "data_context" else None
  assert r["out"] == [batch_axis, seq_axis, None]
