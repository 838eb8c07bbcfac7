"""--loss-reduction and --vision-drop-path-rate in one process.

Loss reduction: a global batch run through megatron-core's schedule in micro-batches (padded and packed, of
several sizes) gives the closed form sum_s w(n_s) sum_i l_i / sum_s w(n_s) n_s computed from per-sample losses
(each sample run alone), in value and in every gradient.  Drop path: rate 0 is the model without the flag, a
rate > 0 changes the loss, recompute replays the mask (also with another micro-batch's forward in between,
as in 1F1B), and the mask is per tile with the layer's rate.
"""
import dataclasses
import math

import pytest
import torch

from omnibal_ext.model.units import build_units, get_preset

PAD = 0


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    from megatron.vlm.data.digits import build_digits_dataset
    from megatron.vlm.data import RecordDataset, TileImages
    from megatron.vlm.data.tokenizer import ByteTokenizer

    spec = get_preset("tiny")
    meta = build_digits_dataset(str(tmp_path_factory.mktemp("digits") / "d"), num_samples=60,
                                tile_size=spec.vision.image_size)
    ds = RecordDataset(meta, ByteTokenizer(), TileImages(spec.vision.image_size, spec.tokens_per_tile, 6), 512)
    globals()["PAD"] = ByteTokenizer().pad_id
    return [{**ds[i], "sample_id": i} for i in range(8)]


def stage(drop_path=0.0, recompute=None, seed=3):
    from megatron.vlm.stage.build import StageBuild, build_stage

    spec = get_preset("tiny")
    return build_stage(StageBuild(spec, range(len(build_units(spec))), img_context_id=263, seed=seed,
                                  recompute=recompute, vision_drop_path_rate=drop_path)).train()


def collate(samples, packed, iteration=0):
    from megatron.vlm.data.collate import collate_packed, collate_padded
    from megatron.vlm.stage.micro_batch import MicroBatch

    fields = collate_packed(samples, PAD, pad_to_multiple=16) if packed else collate_padded(samples, PAD)
    return dataclasses.replace(MicroBatch.of(fields), iteration=iteration)


def answers(sample) -> int:
    return int((torch.as_tensor(sample["labels"]) != -100).sum())


def grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def through_schedule(m, samples, mbs, packed, reduction):
    """(logged loss, grads) of the global batch ``samples`` in micro-batches of ``mbs`` through
    megatron-core's forward_backward_no_pipelining, as the trainer runs it (dp = 1)."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.training.loss_reduction import normaliser
    from megatron.training.training import forward_step

    batches = [collate(samples[i:i + mbs], packed, iteration=1) for i in range(0, len(samples), mbs)]
    num_mb = len(batches)
    norm = sum(normaliser(b.samples.sample_answers, reduction) for b in batches)
    m.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=partial(forward_step, reduction=reduction, scale=num_mb / norm),
        data_iterator=iter(batches), model=[m], num_microbatches=num_mb, seq_length=512,
        micro_batch_size=mbs, forward_only=False)
    total = sum(r["lm loss"] for r in reports)
    # what finalize_model_grads divides by (calculate_per_token_loss): the loss functions' counts, summed
    count = float(sum(r["token loss"][1] for r in reports)) if reduction == "token" else num_mb
    return float(total[0] / total[1]), {n: g / count for n, g in grads(m).items()}


def closed_form(m, samples, reduction):
    """(loss, grads) of sum_s w(n_s) sum_i l_i / sum_s w(n_s) n_s from each sample run alone."""
    from megatron.training.loss_reduction import weight

    m.zero_grad()
    sums, counts = [], []
    for s in samples:
        b = collate([s], packed=False, iteration=1)
        out = m(b).loss
        sums.append((out * (b.text.labels != -100)).sum())
        counts.append(answers(s))
    den = sum(weight(n, reduction) * n for n in counts)
    loss = sum(weight(n, reduction) * v for v, n in zip(sums, counts)) / den
    loss.backward()
    return float(loss.detach()), grads(m)


def test_weights():
    from megatron.training.loss_reduction import normaliser, reduce_loss, weight

    assert [weight(4, r) for r in ("token", "sample", "square")] == [1.0, 0.25, 0.5]
    assert weight(0, "square") == 0.0
    assert normaliser([4, 9, 0], "square") == pytest.approx(2 + 3)
    assert normaliser([4, 9], "sample") == 2.0
    # sample: the mean of the samples' means; token: the mean of all tokens
    assert reduce_loss([4.0, 18.0], [4, 9], "sample") == pytest.approx((1.0 + 2.0) / 2)
    assert reduce_loss([4.0, 18.0], [4, 9], "token") == pytest.approx(22.0 / 13)


@pytest.mark.parametrize("reduction", ["token", "sample", "square"])
def test_schedule_gives_the_closed_form(megatron_world, samples, reduction):
    """Padded micro-batches of 2 and of 4 samples and packed ones of 4 (+ drop path, the same mask either
    way) against the closed form from per-sample losses: loss within 1e-5 relative, gradients within 1e-5
    of their largest entry."""
    m = stage(drop_path=0.2)
    want, want_grads = closed_form(m, samples, reduction)
    for mbs, packed in ((2, False), (4, False), (4, True)):
        got, got_grads = through_schedule(m, samples, mbs, packed, reduction)
        assert got == pytest.approx(want, rel=1e-5), (mbs, packed)
        assert got_grads.keys() == want_grads.keys()
        for n, g in want_grads.items():
            tol = 1e-5 * max(float(g.abs().max()), 1e-6)
            assert torch.allclose(got_grads[n], g, atol=tol, rtol=0), (n, mbs, packed)


def test_square_differs_from_token_on_the_built_in_data(megatron_world, samples):
    from megatron.training.loss_reduction import reduce_loss

    counts = [answers(s) for s in samples]
    assert len(set(counts)) > 1, counts  # the digits answers differ in length
    m = stage().eval()
    with torch.no_grad():
        sums = [float((m(collate([s], False)).loss * (collate([s], False).text.labels != -100)).sum())
                for s in samples]
    token, square, sample = (reduce_loss(sums, counts, r) for r in ("token", "square", "sample"))
    assert abs(square - token) > 1e-4 * token and abs(sample - token) > 1e-4 * token, (token, square, sample)


def _loss(m, batch):
    out = m(batch).loss
    return (out * (batch.text.labels != -100)).sum()


def test_drop_path_rate_zero_is_the_model_without_it(megatron_world, samples):
    batch = collate(samples[:4], packed=False, iteration=5)
    plain, zero, some = stage(), stage(drop_path=0.0), stage(drop_path=0.3)
    assert type(plain.vit_blocks[0].layers[0]) is type(zero.vit_blocks[0].layers[0])
    a, b, c = (_loss(x, batch).detach() for x in (plain, zero, some))
    assert float(a) == float(b)
    assert abs(float(c) - float(a)) > 1e-4 * abs(float(a))
    # the same weights (drop path adds no parameter), and no drop path in evaluation
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), some.parameters()))
    with torch.no_grad():
        assert float(_loss(plain.eval(), batch)) == float(_loss(some.eval(), batch))
    # another iteration draws another mask
    batch2 = dataclasses.replace(batch, iteration=6)
    assert float(_loss(some.train(), batch2).detach()) != float(c)


def test_drop_path_mask_replays_under_recompute(megatron_world, samples):
    """Full recompute of the ViT layers, two micro-batches' forwards before their backwards (1F1B): the
    recomputed layers draw the masks their forwards drew, so gradients equal the run without recompute."""
    from omnibal_ext.memory.recompute import StageRecompute

    spec = get_preset("tiny")
    b1, b2 = collate(samples[:3], False, iteration=2), collate(samples[3:6], True, iteration=2)
    results = []
    for rec in (None, StageRecompute(spec.vision.num_layers, False, 0, False)):
        m = stage(drop_path=0.4, recompute=rec)
        m.zero_grad()
        l1, l2 = _loss(m, b1), _loss(m, b2)
        l1.backward()
        l2.backward()
        results.append((float(l1.detach()), float(l2.detach()), grads(m)))
    (a1, a2, ga), (c1, c2, gc) = results
    assert (a1, a2) == (c1, c2)
    for n in ga:
        assert torch.allclose(ga[n], gc[n], rtol=1e-5, atol=1e-7), n


def test_drop_path_mask_per_tile_and_layer():
    from megatron.vlm.layers.drop_path import iteration_keys, keep_mask, layer_rates, tile_keys

    assert layer_rates(0.4, 5) == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    keys = iteration_keys(tile_keys(list(range(4000)), [3] * 4000), seed=1, iteration=7)
    assert len(set(keys.tolist())) == 12000  # every tile its own key
    mask = keep_mask(keys, layer=3, branch=0, drop_prob=0.25, dtype=torch.float32)
    assert mask.unique().tolist() == pytest.approx([0.0, 1 / 0.75])
    assert float((mask == 0).float().mean()) == pytest.approx(0.25, abs=0.02)
    other = keep_mask(keys, layer=4, branch=0, drop_prob=0.25, dtype=torch.float32)
    assert not torch.equal(mask, other)  # layers draw independently
    again = keep_mask(iteration_keys(tile_keys(list(range(4000)), [3] * 4000), 1, 7), 3, 0, 0.25, torch.float32)
    assert torch.equal(mask, again)  # a pure function of (seed, iteration, sample, tile, layer, branch)
    assert math.isclose(float(mask.mean()), 1.0, abs_tol=0.05)
