"""The stage module and the profiler in one process (world of one, gloo)."""
import dataclasses

import pytest
import torch

from megatron.training.flags import build_parser
from megatron.training.specs import run_config
from omnibal_ext.model.cost_model import MicroBatchShape
from omnibal_ext.model.units import build_units, get_preset


def whole_model(spec, seed=3):
    from megatron.vlm.stage.build import StageBuild, build_stage

    units = build_units(spec)
    return build_stage(StageBuild(spec, range(len(units)), img_context_id=263, seed=seed))


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2)])
def test_segment_attention_equals_dense_masked_attention(megatron_world, heads, groups):
    """SegmentAttention on THD inputs (causal per segment, SDPA) against megatron-core's DotProductAttention
    with the dense block-diagonal mask, values and gradients, on packed and right-padded rows."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.vlm.layers.attention import SegmentAttention, segment_params
    from megatron.vlm.layers.config import language_config
    from megatron.vlm.data.collate import packing
    from megatron.vlm.stage.text import packed_causal_mask

    spec = get_preset("tiny")
    spec = spec.replace(language=dataclasses.replace(spec.language, num_attention_heads=heads, num_query_groups=groups))
    cfg = language_config(spec, 1, True, torch.float32)
    kw = dict(layer_number=1, attention_type="self")
    ours = SegmentAttention(cfg, attn_mask_type=AttnMaskType.causal, **kw)
    ref = DotProductAttention(cfg, attn_mask_type=AttnMaskType.arbitrary, **kw)
    d = spec.language.hidden_size // heads
    g = torch.Generator().manual_seed(0)
    packed = torch.tensor([[0] * 5 + [1] * 9 + [2] * 3 + [-1] * 2])
    padded = torch.tensor([[0] * 7 + [-1] * 3, [0] * 10, [0] * 2 + [-1] * 8])
    for ids in (packed, padded):
        b, s = ids.shape
        q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
        k = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
        v = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
        real = (ids >= 0).T[..., None].float()  # [s, b, 1]: padding outputs are free to differ
        # THD: rows flattened; segments = each run of one id in a row (padding included)
        rows = [torch.unique_consecutive(r, return_counts=True)[1].tolist() for r in ids]
        cu, max_len = packing(rows, s)
        thd = lambda x: x.transpose(0, 1).reshape(b * s, *x.shape[2:])  # noqa: E731
        out = ours(thd(q), thd(k), thd(v), None, packed_seq_params=segment_params(cu, max_len))
        out = out.reshape(b, s, -1).transpose(0, 1)
        want = ref(q, k, v, packed_causal_mask(ids))
        torch.testing.assert_close(out * real, want * real, rtol=1e-5, atol=1e-5)
        w = torch.randn(out.shape, generator=g) * real
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
        want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
        for a, e in zip(grads, want_grads):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_packed_samples_give_the_same_per_sample_loss_as_alone(megatron_world, tmp_path):
    from megatron.vlm.data.collate import collate_packed, collate_padded
    from megatron.vlm.data.digits import build_digits_dataset
    from megatron.vlm.data import RecordDataset, TileImages
    from megatron.vlm.data.tokenizer import ByteTokenizer
    from megatron.vlm.stage.micro_batch import MicroBatch

    spec = get_preset("tiny")
    tok = ByteTokenizer()
    meta = build_digits_dataset(str(tmp_path / "digits"), num_samples=40, tile_size=spec.vision.image_size)
    ds = RecordDataset(meta, tok, TileImages(spec.vision.image_size, spec.tokens_per_tile, 6), 512)
    samples = [ds[i] for i in range(5)]
    model = whole_model(spec).eval()

    def per_token_loss(fields):
        with torch.no_grad():
            return model(MicroBatch.of(fields)).loss

    packed = collate_packed(samples, tok.pad_id)
    loss = per_token_loss(packed)[0]
    assert packed["tokens"].shape[0] == 1 and len(set(packed["segment_ids"][0].tolist())) == 5
    start = 0
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        alone = per_token_loss(collate_padded([s], tok.pad_id))[0]
        mask = s["labels"] != -100
        torch.testing.assert_close(loss[start:start + n][mask], alone[mask], rtol=1e-5, atol=1e-5)
        start += n
    # and padding rows of a padded batch do not leak into other rows
    padded = per_token_loss(collate_padded(samples, tok.pad_id))
    for i, s in enumerate(samples):
        mask = s["labels"] != -100
        alone = per_token_loss(collate_padded([s], tok.pad_id))[0]
        torch.testing.assert_close(padded[i, :len(s["input_ids"])][mask], alone[mask], rtol=1e-5, atol=1e-5)


def test_profile_orders_vit_and_llm_layers_by_size(megatron_world):
    from megatron.training.profiling import profile_units

    base = get_preset("tiny")
    # sizes far apart, so that compute (not per-call overhead) decides the order even on a busy machine
    heavy_vit = base.replace(
        vision=dataclasses.replace(base.vision, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8),
        language=dataclasses.replace(base.language, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
                                     num_query_groups=2))
    heavy_llm = base.replace(
        vision=dataclasses.replace(base.vision, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2),
        language=dataclasses.replace(base.language, hidden_size=512, ffn_hidden_size=1536))
    shape = MicroBatchShape(vision_items=12, llm_tokens=204, dtype_bytes=4)  # as many LLM tokens as ViT tokens

    def layer_fwd(spec, attention_backend="unfused"):
        args = build_parser().parse_args(["--seed", "1", "--attention-backend", attention_backend])
        costs = profile_units(run_config(args, 1), spec, shape, 263, torch.device("cpu"), warmup=1, repeats=3)
        by_kind = {u.kind: u for u in costs.units}
        assert [u.name for u in costs.units] == [u.name for u in build_units(spec)]
        for u in costs.units:
            assert u.fwd_s > 0 and u.bwd_s > 0 and u.send_bytes > 0
        for kind in ("vit_layer", "llm_layer"):
            u = by_kind[kind]
            if attention_backend == "unfused":  # the scores are kept: selective recompute drops them
                assert u.act_bytes_full < u.act_bytes_selective < u.act_bytes
            else:  # SDPA keeps no scores: selective recompute saves nothing worth having
                assert u.act_bytes_full < u.act_bytes and u.act_bytes_selective > 0.95 * u.act_bytes
        return by_kind["vit_layer"].fwd_s + by_kind["vit_layer"].bwd_s, by_kind["llm_layer"].fwd_s + by_kind["llm_layer"].bwd_s

    def ranks(spec, backend, heavier: str) -> tuple:
        """Profile up to three times: a timing order can flip once on a machine busy with other work, a wrong
        cost order flips every time."""
        seen = []
        for _ in range(3):
            vit, llm = layer_fwd(spec, backend)
            seen.append((vit, llm))
            if (vit > llm) == (heavier == "vit"):
                return True, seen
        return False, seen

    for backend in ("unfused", "auto"):  # two profiles of the same models agree in ranking
        for spec, heavier in ((heavy_vit, "vit"), (heavy_llm, "llm")):
            ok, seen = ranks(spec, backend, heavier)
            assert ok, f"{backend}: the {heavier} layer should cost more, (vit, llm) seconds: {seen}"


def test_profile_activation_bytes_match_a_hand_count(megatron_world):
    """The ViT layer's output (what a stage sends) is [seq per tile, tiles, hidden] fp32."""
    from megatron.training.profiling import profile_units

    spec = get_preset("tiny")
    args = build_parser().parse_args(["--seed", "1"])
    costs = profile_units(run_config(args, 1), spec, MicroBatchShape(vision_items=3, llm_tokens=40, dtype_bytes=4), 263, torch.device("cpu"),
                          warmup=0, repeats=1)
    by_kind = {u.kind: u for u in costs.units}
    v = spec.vision
    assert by_kind["vit_layer"].send_bytes == v.seq_per_tile * 3 * v.hidden_size * 4
    assert by_kind["vit_layer"].act_bytes_full == v.seq_per_tile * 3 * v.hidden_size * 4  # its input only
    assert by_kind["llm_layer"].send_bytes == 40 * spec.language.hidden_size * 4
    assert by_kind["projector"].send_bytes == 3 * spec.tokens_per_tile * spec.language.hidden_size * 4
