"""The LLM's packed-sequence (THD) path in one process: against the dense-mask path, RoPE restarting
per sample, and no host sync inside a micro-batch's forward and backward."""
import collections
import contextlib
import os
import traceback

import pytest
import torch

from omnibal_ext.model.units import build_units, get_preset


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    from megatron.vlm.data.digits import build_digits_dataset
    from megatron.vlm.data import RecordDataset, TileImages
    from megatron.vlm.data.tokenizer import ByteTokenizer

    spec = get_preset("tiny")
    meta = build_digits_dataset(str(tmp_path_factory.mktemp("digits") / "d"), num_samples=40,
                                tile_size=spec.vision.image_size)
    ds = RecordDataset(meta, ByteTokenizer(), TileImages(spec.vision.image_size, spec.tokens_per_tile, 6), 512)
    return [ds[i] for i in range(5)]


def stage(attention_backend="auto", seed=3, unit_range=None):
    from megatron.vlm.layers.layer_impl import LayerImpl
    from megatron.vlm.stage.build import StageBuild, build_stage

    spec = get_preset("tiny")
    units = build_units(spec)
    return build_stage(StageBuild(spec, unit_range or range(len(units)), img_context_id=263, seed=seed,
                                  impl=LayerImpl.of("local", attention_backend)))


def batches(samples):
    from megatron.vlm.data.collate import collate_packed, collate_padded
    from megatron.vlm.stage.micro_batch import MicroBatch
    from megatron.vlm.data.tokenizer import ByteTokenizer

    pad = ByteTokenizer().pad_id
    return {"packed": MicroBatch.of(collate_packed(samples, pad, pad_to_multiple=64)),  # ISF: 5 samples + padding
            "padded": MicroBatch.of(collate_padded(samples, pad))}                      # random: one sample per row


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_thd_equals_dense_mask(megatron_world, samples, kind):
    """Local spec, THD (SegmentAttention, megatron-core's cu_seqlens RoPE) against --attention-backend
    unfused (megatron-core's DotProductAttention, dense block-diagonal mask) on identical weights:
    per-token losses of the answer tokens within 1e-6 (fp32), and the same gradients."""
    batch = batches(samples)[kind]
    thd, dense = stage("auto"), stage("unfused")
    assert thd.thd and not dense.thd
    real = batch.text.labels != -100
    losses, grads = [], []
    for m in (thd, dense):
        loss = m(batch).loss
        assert loss.shape == batch.text.tokens.shape
        (loss * real).sum().backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    torch.testing.assert_close(losses[0][real], losses[1][real], rtol=0, atol=1e-6)
    for n in grads[0]:  # fp32 sums over the micro-batch's tokens in another order: 1e-6 of the tensor's scale
        scale = float(grads[1][n].abs().max())
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6 * max(scale, 1.0), msg=n)


def test_stages_carry_thd_hidden_states(megatron_world, samples):
    """Between LLM stages travels [b * s, 1, H] on both attention paths; two stages equal one."""
    spec = get_preset("tiny")
    units = build_units(spec)
    cut = [u.kind for u in units].index("llm_layer") + 2
    batch = batches(samples)["padded"]
    b, s = batch.text.tokens.shape
    for backend in ("auto", "unfused"):
        first, second = stage(backend, unit_range=range(0, cut)), stage(backend, unit_range=range(cut, len(units)))
        with torch.no_grad():
            x = first(batch)
            assert x.shape == (b * s, 1, spec.language.hidden_size)
            second.set_input_tensor(x)
            torch.testing.assert_close(second(batch).loss, stage(backend)(batch).loss, rtol=0, atol=1e-6)


def test_rope_restarts_in_every_packed_sample(megatron_world, samples):
    """A sample's per-token losses are the same alone and packed after others (positions restart)."""
    from megatron.vlm.data.collate import collate_packed
    from megatron.vlm.stage.micro_batch import MicroBatch

    m = stage("auto").eval()
    with torch.no_grad():
        packed = m(MicroBatch.of(collate_packed(samples, 0))).loss[0]
        start = sum(len(s["input_ids"]) for s in samples[:3])
        alone = m(MicroBatch.of(collate_packed([samples[3]], 0))).loss[0]
    n = len(samples[3]["input_ids"])
    real = samples[3]["labels"] != -100
    torch.testing.assert_close(packed[start:start + n][real], alone[real], rtol=0, atol=1e-6)


# Host reads of a tensor's data: each waits for the device on a GPU.
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_host_reads():
    """Count (method, caller) of every Python-level read of tensor data back to the host."""
    calls = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def wrap(name, fn):
        def counted(self, *a, **k):
            where = traceback.extract_stack(limit=2)[0]
            calls[(name, f"{os.path.basename(where.filename)}:{where.name}")] += 1
            return fn(self, *a, **k)
        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_no_host_sync_in_forward_backward(megatron_world, samples, kind):
    """One micro-batch's forward, loss_func and backward read no device tensor back to the host.  What the
    count does see are reads of the host-built cu_seqlens (a documented constant, 1 + 4 x LLM layers):
    the stage's segment_params turns them into Python boundaries once per micro-batch, and
    megatron-core's unfused THD RoPE (rope_utils._apply_rotary_pos_emb_thd) reads
    the host-built cu_seqlens with .tolist() and compares their last entry (a host __bool__), once for the
    query and once for the key of every LLM layer.  Those tensors live on the host (the trainer does not
    move cu_seqlens), so on a GPU they are no device sync; with TransformerEngine, TE's fused THD RoPE
    replaces them."""
    from megatron.training.training import loss_func

    batch = batches(samples)[kind]
    m = stage("auto").train()
    llm_layers = get_preset("tiny").language.num_layers
    m(batch)  # first call: RoPE frequencies and lazy state built outside the count
    with count_host_reads() as calls:
        out = m(batch)
        loss, _, _ = loss_func(batch, out.correct, out.loss)
        loss.backward()
        out = m(batch)  # --loss-reduction square: weights from the host's answer counts, no read either
        loss, _, _ = loss_func(batch, out.correct, out.loss, reduction="square", scale=0.5)
        loss.backward()
    assert dict(calls) == {("tolist", "attention.py:segment_params"): 2,  # two forwards
                           ("tolist", "rope_utils.py:_apply_rotary_pos_emb_thd"): 4 * llm_layers,
                           ("__bool__", "rope_utils.py:_apply_rotary_pos_emb_thd"): 4 * llm_layers}


def test_the_counter_sees_host_reads():
    x = torch.arange(4.0)
    with count_host_reads() as calls:
        int(x.sum()), x.tolist(), bool(x[0]), x.max().item()
    assert sum(calls.values()) == 4


@pytest.mark.parametrize("recompute", [(2, False, 2, False), (0, True, 0, True)], ids=["full", "selective"])
def test_recompute_on_the_thd_path_changes_nothing(megatron_world, samples, recompute):
    """megatron-core's full (block) and selective (core attention) recompute carry packed_seq_params."""
    from megatron.vlm.stage.build import StageBuild, build_stage
    from omnibal_ext.memory.recompute import StageRecompute

    spec = get_preset("tiny")
    units = build_units(spec)
    batch = batches(samples)["packed"]
    out = []
    for plan in (StageRecompute(), StageRecompute(*recompute)):
        m = build_stage(StageBuild(spec, range(len(units)), img_context_id=263, seed=3, recompute=plan)).train()
        loss = m(batch).loss
        loss.sum().backward()
        out.append((loss.detach(), [p.grad for p in m.parameters()]))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=1e-6)
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
