"""`python -m bench.gpu` on a host without a GPU, and what its figures rest on: the useful
work it counts, and which kernel serves which cell on a GPU (decided from the calls alone,
so it is checked here, with the measurements stubbed)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import flaxattn
from bench import gpu, measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_skips_without_a_gpu(tmp_path):
  out = tmp_path / "gpu.json"
  done = subprocess.run([sys.executable, "-m", "bench.gpu", "--json", str(out)], cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  line = "bench.gpu: no GPU (jax.default_backend() is 'cpu'); nothing measured"
  assert done.stdout.strip() == line
  assert json.loads(out.read_text()) == {"skipped": "no GPU (jax.default_backend() is 'cpu')"}


def _one_document(t):
  return np.ones((1, t), np.int32)


@pytest.mark.parametrize("t", [1000, 8192, 131072])
def test_useful_pairs_in_closed_form(t):
  causal = t * (t + 1) // 2
  assert measure.useful_pairs(flaxattn.Causal(), _one_document(t)) == causal
  assert measure.flops(causal) == (causal * 4 * measure.H * measure.D,
                                   causal * 4 * measure.H * measure.D * 3.5)
  n = t // measure.DOCS  # 16 equal documents, and padding where 16 does not divide t
  seg, _ = measure.packed_row(t)
  assert measure.useful_pairs(flaxattn.Causal(), seg) == measure.DOCS * n * (n + 1) // 2
  for w in (1, 4096, 2 * t):  # position p sees min(p + 1, w) keys
    m = min(w, t)
    want = m * (m + 1) // 2 + (t - m) * m
    assert measure.useful_pairs(flaxattn.Local(w), _one_document(t)) == want
  for c in (1, 8192, 3 * t):  # position p sees p mod c + 1 keys
    full, rest = divmod(t, c)
    want = full * c * (c + 1) // 2 + rest * (rest + 1) // 2
    assert measure.useful_pairs(flaxattn.Chunked(c), _one_document(t)) == want


def test_useful_pairs_match_the_masks_pair_by_pair():
  rng = np.random.default_rng(0)
  t = 300
  seg = np.zeros((1, t), np.int32)
  pos = np.zeros((1, t), np.int32)
  cuts = np.sort(rng.choice(np.arange(1, t - 20), 5, replace=False))
  for doc, (a, b) in enumerate(zip([0, *cuts], [*cuts, t - 20], strict=True), 1):
    seg[0, a:b], pos[0, a:b] = doc, np.arange(b - a)  # 20 tokens of padding at the end
  same = (seg[0, :, None] == seg[0, None, :]) & (seg[0, :, None] != 0)
  for mask in (flaxattn.Causal(), flaxattn.Local(7), flaxattn.Chunked(16),
               flaxattn.Local(40) & flaxattn.Chunked(32)):
    allowed = same & np.asarray(mask.allows(pos[0, :, None], pos[0, None, :]))
    assert measure.useful_pairs(mask, seg) == int(allowed.sum()), mask


def test_document_case_counts_its_documents_in_their_original_order():
  case = gpu.make_case("document", 8192)
  n = 8192 // 16 - gpu.SHORTER
  assert case.pairs == 16 * n * (n + 1) // 2
  assert case.segment_ids is not None and case.positions is not None
  seg, pos = case.segment_ids[0], case.positions[0]
  assert sorted(np.bincount(seg)[1:]) == [n] * 16
  assert sorted(pos[seg == 1]) == list(range(n))
  assert not np.array_equal(pos[seg == 1], np.arange(n))  # cut into pieces, reordered


def test_every_cell_on_a_gpu(monkeypatch):
  """Which row serves which case (the registry's decisions for a GPU, cuDNN's run-time check
  on each batch), with stub measurements: copies, declines and the tables."""
  measured = []

  def fake(name, case, *args):
    measured.append((name, case.name))
    return dict(fwd_tflops=1.0 + len(measured), fb_tflops=2.0, temp_bytes=2**20)
  monkeypatch.setattr(gpu, "_run_jax", fake)
  monkeypatch.setattr(gpu, "_run_torch", lambda case, *args: fake("torch_sdpa", case))
  monkeypatch.setattr(measure, "inputs", lambda t: None)  # not measured: no inputs
  missing = {"tokamax": "tokamax is not installed", "torch": None}
  cells = gpu.run_cells([8192], repeats=1, matmul=100.0, missing=missing)
  by = {(c["kernel"], c["case"]): c for c in cells}
  assert len(cells) == len(gpu.ROWS) * len(gpu.CASES)

  def status(name, case):
    return by[(name, case)]["status"]
  for case in gpu.CASES:
    assert status("pallas_gpu", case) == status("blockwise", case) == "ok"
    assert status("tokamax_mosaic", case) == "absent"
    auto = by[("auto", case)]
    assert auto["runs"] == ("cudnn" if case in ("causal", "local") else "mosaic_gpu")
    assert auto["fwd_tflops"] == by[(auto["runs"], case)]["fwd_tflops"]  # its row's program
  assert "chunked" in by[("cudnn", "chunked")]["reason"]
  assert "budget" in by[("cudnn", "packed")]["reason"]
  assert status("cudnn_thd16", "packed") == status("cudnn_thd32", "packed") == "ok"
  # Documents cut into pieces: cuDNN's masks by index cannot serve them; its fallback runs.
  assert status("cudnn_thd16", "document") == status("cudnn_thd32", "document") == "fallback"
  assert by[("cudnn_thd16", "causal")]["same_as"] == {"kernel": "cudnn", "case": "causal"}
  for case in ("packed", "chunked", "document"):
    assert status("jax_nn_cudnn", case) == "declined"
  for case in ("causal", "local", "chunked"):
    assert status("docs_as_rows", case) == "declined"
  assert [case for name, case in measured if name == "torch_sdpa"] == ["causal"]
  assert len(measured) == len(set(measured))  # copies are not measured again
  lines = gpu.tables(cells, [8192], 100.0)
  assert sum(line.startswith("| flaxattn auto |") for line in lines) == len(gpu.CASES)


def test_tilings_run_each_kernel_under_each_tiling(monkeypatch):
  """--tilings: each of TILINGS (pallas_gpu) and MOSAIC_TILINGS (mosaic_gpu) on each tiling
  case is measured once, with a kernel of that tiling, and tabled one row per tiling in a
  table per kernel (measurements stubbed)."""
  measured = []

  def fake(name, case, qkv, matmul, repeats, kernel=None):
    measured.append((name, case.name, kernel))
    return dict(fwd_tflops=float(len(measured)), fb_tflops=2.0, temp_bytes=2**20)
  monkeypatch.setattr(gpu, "_run_jax", fake)
  monkeypatch.setattr(measure, "inputs", lambda t: None)
  cells = gpu.run_tilings(repeats=1, matmul=100.0)
  tilings = len(gpu.TILINGS) + len(gpu.MOSAIC_TILINGS)
  assert len(cells) == len(measured) == tilings * len(gpu.TILING_CASES)
  for (name, case, kernel), cell in zip(measured, cells, strict=True):
    assert name == cell["kernel"] == kernel.name and cell["case"] == case
  pallas = [k for name, _, k in measured if name == "pallas_gpu"]
  mosaic = [k for name, _, k in measured if name == "mosaic_gpu"]
  assert {(k.block_q, k.block_kv, k.num_warps, k.num_stages) for k in pallas} == set(gpu.TILINGS)
  assert {(k.block_kv, k.block_kv_dq, k.block_q_dkv, k.stages) for k in mosaic} == set(
      gpu.MOSAIC_TILINGS)
  lines = gpu.tiling_table(cells)
  assert [line for line in lines if line.startswith("### ")] == [
      "### pallas_gpu tilings at 32K: TFLOP/s of useful work",
      "### mosaic_gpu tilings at 32K: TFLOP/s of useful work"]
  rows = [line for line in lines if line.startswith("| ") and "x" in line.split("|")[1]
          and "block_q" not in line]
  assert len(rows) == len(gpu.TILINGS)
  assert sum(line.startswith("| kv") for line in lines) == len(gpu.MOSAIC_TILINGS)
  n = tilings  # the first tiling: measured first in each of the two cases
  assert rows[0] == f"| 128x64 w8 s2 | 1.0 | 2.0 | {gpu._number(n + 1.0)} | 2.0 |"


def test_decode_row_runs_small_here(tmp_path):
  """The decode row's code on this host with a small layer (what a GPU run would hit first):
  the step, the loop, the attention alone and jax.nn's, no step refused, the floor from
  the bytes read; and `--decode` with no kernel row skips cleanly without a GPU."""
  shape = gpu.DecodeShape(embed=64, heads=4, kv_heads=2, room=16, loop=4)
  row = gpu.decode_row(256, 1, 1e10, shape)
  assert row["kernel"] == "split_k"  # what "auto" takes for a GPU's decode step
  # keys and values [1, 256, 2, 16] bf16, ids and positions int32; the q and out weights
  # [64, 64] and the k and v weights [64, 32], bf16
  assert row["bytes_read"] == 2 * 256 * 2 * 16 * 2 + 2 * 256 * 4 + (2 * 64 * 64 + 2 * 64 * 32) * 2
  assert row["floor_ms"] == pytest.approx(row["bytes_read"] / 1e10 * 1e3)
  for key in ("step_ms", "loop_step_ms", "attention_ms", "jax_nn_xla_ms"):
    assert row[key] > 0
  assert row["step_over_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"])
  assert len(gpu.decode_table([row])) == 4
  if jax.default_backend() != "gpu":
    path = tmp_path / "decode.json"
    assert gpu.main(["--decode", "--rows", "--trainer-steps", "0", "--json", str(path)]) == 0
    assert "no GPU" in json.loads(path.read_text())["skipped"]


def test_goals_skip_without_a_gpu(tmp_path):
  """`python -m bench.gpu_goals` without a GPU: one line, exit 0, the JSON says why."""
  from bench import gpu_goals
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present: bench.gpu_goals measures instead")
  path = tmp_path / "goals.json"
  assert gpu_goals.main(["--json", str(path)]) == 0
  assert "no GPU" in json.loads(path.read_text())["skipped"]


def test_goals_chunked_case_is_33_documents_in_document_order():
  """The chunked goal's row: one document of 16K and 32 of 512 filling 32K, reordered as a
  2-way ring's document order (documents cut into pieces, positions kept), its useful pairs
  counted on the original row."""
  from bench import gpu_goals
  seg, pos, pairs, _ = gpu_goals.chunked_case()
  assert seg.shape == pos.shape == (1, gpu_goals.T_CHUNKED)
  assert sorted(np.unique(seg).tolist()) == list(range(1, 34))
  assert np.count_nonzero(seg == 1) == 16384 and all(
      np.count_nonzero(seg == d) == 512 for d in range(2, 34))
  assert not np.array_equal(seg[0], np.sort(seg[0]))  # reordered
  for d in range(1, 34):  # each document's positions, in some order, are 0..n-1
    assert sorted(pos[seg == d].tolist()) == list(range(np.count_nonzero(seg == d)))
  original = np.repeat(np.arange(1, 34, dtype=np.int32), [16384] + [512] * 32)[None]
  assert pairs == measure.useful_pairs(flaxattn.Chunked(8192), original)
