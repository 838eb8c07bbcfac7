"""Pipeline stages of an InternVL-style VLM, built from megatron-core parts.

A stage holds a contiguous slice of the unit list (omnibal_ext.model.units): any mix of the ViT
patch embedding, ViT layers, projector, LLM embedding, LLM layers and output head.  ViT layers
are placed like any other layer, so a stage may end the ViT and start the LLM.

Stage I/O.  Every stage reads the micro-batch (tokens, tiles, ...) it needs; between stages one
tensor travels, in megatron's [sequence, batch, hidden] order:
  inside the ViT           [tokens per tile, tiles, vision hidden]
  after the projector      [image tokens of all tiles, 1, LLM hidden]
  inside the LLM           [rows x sequence, 1, LLM hidden]  (THD: the micro-batch's rows flattened)
  out of the last stage    per-token loss [rows, sequence] (fp32)
The shapes change along the pipeline, so the config sets ``variable_seq_lengths``.

Packed sequences.  The LLM runs in megatron-core's THD convention: the collate's host-built
``cu_seqlens`` (each sample, each run of padding, over the flattened micro-batch) become one
``PackedSeqParams(qkv_format="thd")`` per micro-batch (``VLMStage.llm_context``), passed to every LLM
TransformerBlock; RoPE restarts in each segment (megatron-core's ``apply_rotary_pos_emb`` with
``cu_seqlens``) and the core attention (``SegmentAttention`` on the local spec, TransformerEngine's
fused attention on the TE spec) stays causal within each segment.  Random (padded) micro-batches are
packed the same way, so there is one attention path.  Only ``--attention-backend unfused`` (megatron-core's
``DotProductAttention``, which refuses THD) gets the dense block-diagonal mask: its blocks see
``[sequence, rows, hidden]``, converted at the stage's LLM entry and exit, so stages carry one shape.

No host sync.  Nothing in a micro-batch's forward or backward reads a device tensor on the host: the
segment boundaries, ``max_seqlen`` and the real tiles' indices come from the collate (the host).

Recompute.  A stage's ViT layers and LLM layers are each split into megatron TransformerBlocks
("segments"): the first ``*_full_layers`` layers fully recomputed, the rest with selective
(core-attention) recompute or none, so every stage can get its own plan.

Initialisation is seeded per unit (seed, unit index), so a unit has the same weights whichever
stage builds it and whatever the tensor-parallel size (megatron's CPU initialisation draws the
full matrix before splitting it): parallel runs reproduce the serial run.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType, ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor
from megatron.vlm.attention import SegmentAttention, segment_params

from omnibal_ext.memory.recompute import StageRecompute
from omnibal_ext.model.units import ModelSpec, Unit


def unit_seed(seed: int, unit_index: int) -> int:
    return (seed * 1_000_003 + 7919 * (unit_index + 1)) % (2**31 - 1)


@contextlib.contextmanager
def seeded(seed: int, unit_index: int):
    """Draw a unit's parameters from its own seed, leaving the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(seed, unit_index))
        yield


class SeededTransformerLayer(TransformerLayer):
    """A TransformerLayer whose weights are drawn from a generator seeded by its unit index.

    real_heads: the model's attention heads when the config may hold padded ones (the ViT): the layer's
    matrices are then drawn by ``draw_padded_layer`` instead of megatron's initialisation.
    """

    def __init__(self, config, submodules, layer_number=1, seed=0, first_unit_index=0, real_heads=None, **kwargs):
        unit = first_unit_index + layer_number - 1
        with seeded(seed, unit):
            super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        if real_heads is not None:
            with seeded(seed, unit):
                draw_padded_layer(self, config, real_heads)


def draw_padded_layer(layer: TransformerLayer, config: TransformerConfig, real_heads: int) -> None:
    """Draw a multi-head layer's matrices for ``real_heads`` heads and zero the padded heads after them.

    ``config.num_attention_heads`` >= real_heads (a multiple of the TP size). The full matrices of the
    real model are drawn on the host in a fixed order (QKV, out-projection, MLP in, MLP out), so a
    layer's weights are the same at every TP size, padded or not, and this rank keeps its slice;
    biases start at zero. Megatron's fused QKV holds, per head, rows [q | k | v] of ``kv_channels``
    each; the out-projection's input columns follow the heads. A padded head's q, k, v are zero, so
    its attention output is zero; its out-projection columns are zero, so that output reaches nothing
    and every gradient the head gets is zero: padded heads stay zero under training.

    megatron-core's own initialisation still runs first and is overwritten here: it is also what marks
    the weights tensor-parallel (with ``perform_initialization`` off the gradient norm would count the
    TP shards as replicated).
    """
    heads, d, h = config.num_attention_heads, config.kv_channels, config.hidden_size
    if config.num_query_groups not in (None, heads):
        raise ValueError("draw_padded_layer: multi-head attention only (the ViT's)")
    if not 1 <= real_heads <= heads:
        raise ValueError(f"draw_padded_layer: {real_heads} real heads for a layer of {heads}")
    tp = config.tensor_model_parallel_size
    rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    mine = slice(rank * heads // tp, (rank + 1) * heads // tp)
    qkv = torch.zeros(heads, 3 * d, h)
    config.init_method(qkv[:real_heads])
    proj = torch.zeros(h, heads, d)
    proj_real = torch.empty(h, real_heads, d)
    config.output_layer_init_method(proj_real)
    proj[:, :real_heads] = proj_real
    fc1 = torch.empty(config.ffn_hidden_size, h)
    config.init_method(fc1)
    fc2 = torch.empty(h, config.ffn_hidden_size)
    config.output_layer_init_method(fc2)
    ffn_mine = slice(rank * config.ffn_hidden_size // tp, (rank + 1) * config.ffn_hidden_size // tp)
    attn, mlp = layer.self_attention, layer.mlp
    with torch.no_grad():
        for linear, full in ((attn.linear_qkv, qkv[mine].reshape(-1, h)), (attn.linear_proj, proj[:, mine].reshape(h, -1)),
                             (mlp.linear_fc1, fc1[ffn_mine]), (mlp.linear_fc2, fc2[:, ffn_mine])):
            linear.weight.copy_(full.to(linear.weight.dtype))
            if getattr(linear, "bias", None) is not None:
                linear.bias.zero_()


class LayerScale(torch.nn.Module):
    """Bias-dropout-add with a trained per-channel scale of the branch: ``residual + scale * (x + bias)``.

    Used as a TransformerLayer's ``self_attn_bda`` / ``mlp_bda`` submodule (InternViT's layer scale:
    ``lambda_1``/``ls1`` is the attention branch's ``self_attn_bda.scale``, ``lambda_2``/``ls2`` the MLP
    branch's ``mlp_bda.scale``), a parameter of shape [hidden] kept apart from the weights (replicated
    over TP). Called like megatron-core's bias-dropout-add: ``bda(training, fused)(x_with_bias, residual,
    dropout_prob)``.
    """

    def __init__(self, hidden_size: int, init_value: float):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((hidden_size,), float(init_value)))

    def forward(self, training: bool, fused: bool = False):
        def bias_dropout_scale_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            x = F.dropout(x, p=prob, training=training) * self.scale
            return residual + x

        return bias_dropout_scale_add


class FullWidthQKNorm(MegatronModule):
    """RMSNorm of q (or k) over the full width of all heads, as InternViT-6B's qk-norm.

    Built as SelfAttention's ``q_layernorm`` / ``k_layernorm`` submodule, it gets this rank's heads
    [s, b, heads per rank, head_dim] and normalises each token over ``real_heads * head_dim`` values:
    under tensor parallelism the sum of squares is all-reduced over the TP group (forward and backward)
    and divided by the real width (padded heads are zero and add nothing). The weight covers this rank's
    heads ([heads per rank * head_dim], split over TP like the heads; padded heads' entries stay unused).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, real_heads: int | None = None):
        super().__init__(config=config)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.tp = config.tensor_model_parallel_size
        local_heads = config.num_attention_heads // self.tp
        self.real_width = (real_heads or config.num_attention_heads) * hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(local_heads * hidden_size, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(*shape[:-2], -1).float()
        ss = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:  # all-reduce forward, all-reduce backward (every rank's output depends on the sum)
            ss = tensor_parallel.reduce_from_tensor_model_parallel_region(
                tensor_parallel.copy_to_tensor_model_parallel_region(ss))
        y = (flat * torch.rsqrt(ss / self.real_width + self.eps)).to(x.dtype)
        return (self.weight * y).reshape(shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


_NO_BIAS_CLASSES: dict = {}


def without_bias(linear_cls: type) -> type:
    """``linear_cls`` built without a bias whatever the ``bias`` its builder passes (megatron-core gives
    linear_qkv a bias whenever ``add_bias_linear`` is set; the ViT keeps biases elsewhere)."""
    if linear_cls not in _NO_BIAS_CLASSES:
        def __init__(self, *args, bias=True, **kwargs):
            linear_cls.__init__(self, *args, bias=False, **kwargs)

        _NO_BIAS_CLASSES[linear_cls] = type(f"{linear_cls.__name__}NoBias", (linear_cls,), {"__init__": __init__})
    return _NO_BIAS_CLASSES[linear_cls]


def base_layer_spec(normalization: str, transformer_impl: str = "local") -> ModuleSpec:
    """megatron-core's layer spec: torch modules ("local") or TransformerEngine's fused ones.

    With TransformerEngine the normalisation comes from the config (fused into the linear layers).
    """
    if transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization=normalization)


def _layer_spec(normalization: str, mask_type: AttnMaskType, seed: int, first_unit_index: int,
                transformer_impl: str = "local", attention_backend: str = "auto",
                real_heads: int | None = None, vision=None) -> ModuleSpec:
    """vision: the VisionSpec whose per-layer features (qkv bias off, qk-norm, layer scale) the layer gets."""
    spec = copy.deepcopy(base_layer_spec(normalization, transformer_impl))
    spec.module = SeededTransformerLayer
    spec.params = {**spec.params, "seed": seed, "first_unit_index": first_unit_index, "real_heads": real_heads}
    attn = spec.submodules.self_attention
    attn.params = {**attn.params, "attn_mask_type": mask_type}
    if uses_segment_attention(transformer_impl, attention_backend):
        attn.submodules.core_attention = SegmentAttention
    if vision is not None:
        if not vision.qkv_bias:
            attn.submodules.linear_qkv = without_bias(attn.submodules.linear_qkv)
        if vision.qk_norm:
            norm = ModuleSpec(module=FullWidthQKNorm, params={"real_heads": real_heads})
            attn.submodules.q_layernorm = norm
            attn.submodules.k_layernorm = copy.deepcopy(norm)
        if vision.layer_scale_init is not None:
            scale = ModuleSpec(module=LayerScale, params={"hidden_size": vision.hidden_size,
                                                          "init_value": vision.layer_scale_init})
            spec.submodules.self_attn_bda = scale
            spec.submodules.mlp_bda = copy.deepcopy(scale)
    return spec


def llm_mask_type(transformer_impl: str, attention_backend: str) -> AttnMaskType:
    """The LLM layers' mask type: causal within each THD segment (TransformerEngine's THD kernels want
    ``padding_causal``), or ``arbitrary`` for megatron-core's DotProductAttention and its dense mask."""
    if transformer_impl == "transformer_engine":
        return AttnMaskType.padding_causal
    return AttnMaskType.causal if uses_segment_attention(transformer_impl, attention_backend) else AttnMaskType.arbitrary


def uses_segment_attention(transformer_impl: str, attention_backend: str) -> bool:
    """Local layers take SegmentAttention (segment ids, SDPA) unless --attention-backend unfused asks for
    megatron-core's DotProductAttention (dense mask, attention scores kept: what selective recompute saves)."""
    if attention_backend not in ("auto", "unfused"):
        raise ValueError(f"attention backend must be 'auto' or 'unfused', got {attention_backend!r}")
    return transformer_impl == "local" and attention_backend == "auto"


def segment_configs(base: TransformerConfig, num_layers: int, full_layers: int, selective: bool):
    """Split ``num_layers`` into (num_layers, config) segments carrying their recompute settings."""
    if full_layers < 0 or full_layers > num_layers:
        raise ValueError(f"recompute of {full_layers} full layers on a stage with {num_layers} layers")
    segments = []
    if full_layers:
        segments.append((full_layers, dataclasses.replace(
            base, num_layers=full_layers, recompute_granularity="full", recompute_method="block",
            recompute_num_layers=full_layers)))
    rest = num_layers - full_layers
    if rest:
        segments.append((rest, dataclasses.replace(
            base, num_layers=rest, recompute_granularity="selective" if selective else None,
            recompute_method=None, recompute_num_layers=None)))
    return segments


class VisionEmbedding(MegatronModule):
    """Tiles [n, C, S, S] -> patch tokens plus a class token, with learned positions: [1 + P, n, H]."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig):
        super().__init__(config=config)
        v = spec.vision
        self.patch = torch.nn.Conv2d(v.in_channels, v.hidden_size, kernel_size=v.patch_size, stride=v.patch_size)
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, v.hidden_size) * spec.init_method_std)
        self.position = torch.nn.Parameter(torch.randn(1, v.seq_per_tile, v.hidden_size) * spec.init_method_std)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixel_values.to(self.patch.weight.dtype)).flatten(2).transpose(1, 2)  # [n, P, H]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.position
        return x.transpose(0, 1).contiguous()  # [1 + P, n, H]


class Projector(MegatronModule):
    """ViT output -> drop class token -> pixel shuffle -> LayerNorm -> MLP (tensor parallel).

    [1 + P, n, Hv] -> [n * tokens_per_tile, 1, Hl]
    """

    def __init__(self, spec: ModelSpec, config: TransformerConfig):
        super().__init__(config=config)
        self.grid = int(round(spec.vision.patches_per_tile**0.5))
        self.factor = int(round(1 / spec.downsample_ratio))
        in_size, hidden = spec.projector_in_size, spec.language.hidden_size
        self.norm = torch.nn.LayerNorm(in_size)
        init = config.init_method
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            in_size, hidden, config=config, init_method=init, bias=True, gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(
            hidden, hidden, config=config, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False)

    def forward(self, vit_out: torch.Tensor) -> torch.Tensor:
        x = vit_out[1:].transpose(0, 1)  # [n, P, Hv]
        n, _, h = x.shape
        g, f = self.grid, self.factor
        x = x.reshape(n, g // f, f, g // f, f, h).permute(0, 1, 3, 2, 4, 5)
        x = x.reshape(n * (g // f) ** 2, f * f * h)
        x, _ = self.fc1(self.norm(x))
        x, _ = self.fc2(F.gelu(x))
        return x.unsqueeze(1)


def word_embedding(spec: ModelSpec, config: TransformerConfig) -> tensor_parallel.VocabParallelEmbedding:
    """The vocabulary-parallel token embedding (drawn first in the llm.embed unit's seed; a tied output
    layer on another stage draws the same weights the same way)."""
    return tensor_parallel.VocabParallelEmbedding(
        spec.language.vocab_size, spec.language.hidden_size, init_method=config.init_method, config=config)


class TextEmbedding(MegatronModule):
    """Token embedding (vocabulary-parallel) with image features written into image-context slots.

    tokens [b, s] and image features [n * T, 1, H] -> [b * s, 1, H] (rows flattened: THD).
    """

    def __init__(self, spec: ModelSpec, config: TransformerConfig, img_context_id: int, tokens_per_tile: int):
        super().__init__(config=config)
        self.word = word_embedding(spec, config)
        self.img_context_id = img_context_id
        self.tokens_per_tile = tokens_per_tile

    def forward(self, tokens, image_features, image_tile_index):
        """image_tile_index: the real tiles' indices (host-built by the collate, which also checks that the
        image-context tokens number real tiles x tokens per tile: no count is read back here)."""
        emb = self.word(tokens.reshape(1, -1))  # [1, t, H], t = b * s
        feats = image_features.squeeze(1).reshape(-1, self.tokens_per_tile, emb.shape[-1])
        feats = feats.index_select(0, image_tile_index).reshape(-1, emb.shape[-1])
        slots = (tokens == self.img_context_id).reshape(1, -1, 1)
        emb = emb.masked_scatter(slots, feats.to(emb.dtype))
        return emb.transpose(0, 1).contiguous()  # [t, 1, H]


class OutputHead(MegatronModule):
    """Final norm, vocabulary-parallel output layer and cross entropy: [b * s, 1, H], labels [b, s] -> loss [b, s]."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, norm_module):
        super().__init__(config=config)
        self.norm = norm_module(config=config, hidden_size=spec.language.hidden_size, eps=config.layernorm_epsilon)
        self.output = tensor_parallel.ColumnParallelLinear(
            spec.language.hidden_size, spec.language.vocab_size, config=config,
            init_method=config.init_method, bias=False, gather_output=False)
        self.last_token_correct = None  # [b, s] bool, argmax == label, set by forward
        self.vocab_size, self.real_vocab = spec.language.vocab_size, spec.language.vocab_real
        # True: forward returns this TP rank's logits [t, 1, V/tp] instead of the loss (scripts/hf_logits.py)
        self.return_logits = False

    def forward(self, hidden, labels):
        logits, _ = self.output(self.norm(hidden))  # [t, 1, V/tp]
        if self.return_logits:
            return logits
        targets = labels.clamp(min=0).reshape(-1, 1)
        if self.real_vocab < self.vocab_size:  # padded rows take no part in the softmax nor the argmax
            logits = mask_padded_vocab(logits.float(), self.real_vocab)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets)
        self.last_token_correct = _vocab_parallel_argmax_matches(logits.detach(), targets).reshape(labels.shape)
        return loss.reshape(labels.shape)  # [b, s]


# what padded vocabulary rows' logits become: exp() of it minus any real logit is exactly 0 in fp32
PADDED_LOGIT = -1e30


def mask_padded_vocab(logits: torch.Tensor, real_vocab: int) -> torch.Tensor:
    """This TP rank's logits [..., V/tp] with the columns of padded vocabulary rows (global id >=
    ``real_vocab``) set to ``PADDED_LOGIT``."""
    part = logits.shape[-1]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    start = parallel_state.get_tensor_model_parallel_rank() * part if tp > 1 else 0
    if start + part <= real_vocab:
        return logits
    padded = torch.arange(start, start + part, device=logits.device) >= real_vocab
    return logits.masked_fill(padded, PADDED_LOGIT)


def _vocab_parallel_argmax_matches(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Whether the target holds the maximal logit over the whole (tensor-parallel split) vocabulary."""
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    part = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    local_max = logits.max(dim=-1).values
    inside = (targets >= start) & (targets < start + part)
    idx = (targets - start).clamp(0, part - 1)
    target_logit = torch.where(inside, logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(local_max))
    if tp > 1:
        torch.distributed.all_reduce(local_max, op=torch.distributed.ReduceOp.MAX, group=group)
        torch.distributed.all_reduce(target_logit, group=group)
    return target_logit >= local_max


def build_tied_embedding_group(embed_stage: int, head_stage: int):
    """The process group of the ranks holding the tied embedding (pipeline stage ``embed_stage``) and the
    output layer (``head_stage``) in this rank's pipeline; None if this rank holds neither. Every rank
    must call it (it creates one group per pipeline group, in the same order everywhere)."""
    import torch.distributed as dist

    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(pp_ranks))
    mine = None
    for ranks in sorted({tuple(g) for g in gathered}):
        pair = [ranks[embed_stage], ranks[head_stage]]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def packed_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask [b, 1, s, s] (True = masked) from segment ids (-1 = padding).

    Tokens attend only to earlier tokens of the same packed sample; padding attends to itself.
    """
    s = segment_ids.shape[1]
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = same & causal & (segment_ids.unsqueeze(1) >= 0)
    allowed |= torch.eye(s, dtype=torch.bool, device=segment_ids.device)
    return (~allowed).unsqueeze(1)


class VLMStage(MegatronModule):
    """One pipeline stage: the units ``unit_range`` of the model's unit list."""

    def __init__(self, spec: ModelSpec, units: list[Unit], unit_range: range, config: TransformerConfig,
                 vit_config: TransformerConfig, llm_config: TransformerConfig, img_context_id: int,
                 seed: int, recompute: StageRecompute | None = None, transformer_impl: str = "local",
                 attention_backend: str = "auto"):
        super().__init__(config=config)
        self.transformer_impl = transformer_impl
        self.attention_backend = attention_backend
        if transformer_impl == "transformer_engine" and attention_backend == "unfused":
            raise ValueError("--attention-backend unfused is megatron-core's DotProductAttention (local layers)")
        self.segment_attention = uses_segment_attention(transformer_impl, attention_backend)
        self.thd = attention_backend != "unfused"  # LLM layers take packed sequences (else: the dense mask)
        if transformer_impl == "transformer_engine":  # TE's fused THD RoPE reads cu_seqlens on the device;
            llm_config = dataclasses.replace(llm_config, apply_rope_fusion=True)  # megatron's unfused one
            # would read them on the host (.tolist()) in every layer
        self.model_type = ModelType.encoder_or_decoder
        # Read by megatron's finalize_model_grads: its embedding group (first and last stage) cannot say
        # where E sits in our layouts, so tied embeddings are kept in sync by this module itself.
        self.pre_process = unit_range.start == 0
        self.post_process = unit_range.stop == len(units)
        self.share_embeddings_and_output_weights = False
        recompute = recompute or StageRecompute()
        self.spec = spec
        self.units = [units[i] for i in unit_range]
        self.kinds = [u.kind for u in self.units]
        self.input_tensor = None
        self.recompute = recompute
        first = {k: next((u.index for u in self.units if u.kind == k), None) for k in
                 ("vit_embed", "vit_layer", "projector", "llm_embed", "llm_layer", "llm_head")}
        n_vit = self.kinds.count("vit_layer")
        n_llm = self.kinds.count("llm_layer")
        self.vit_embed = self.projector = self.text_embed = self.head = None
        if first["vit_embed"] is not None:
            with seeded(seed, first["vit_embed"]):
                self.vit_embed = VisionEmbedding(spec, vit_config)
        self.vit_blocks = self._blocks(vit_config, spec.vision.normalization, AttnMaskType.no_mask, seed,
                                       first["vit_layer"], n_vit, recompute.vit_full_layers, recompute.vit_selective,
                                       real_heads=spec.vision.num_attention_heads, vision=spec.vision)
        if first["projector"] is not None:
            with seeded(seed, first["projector"]):
                self.projector = Projector(spec, llm_config)
        if first["llm_embed"] is not None:
            with seeded(seed, first["llm_embed"]):
                self.text_embed = TextEmbedding(spec, llm_config, img_context_id, spec.tokens_per_tile)
        self.llm_blocks = self._blocks(llm_config, spec.language.normalization,
                                       llm_mask_type(transformer_impl, attention_backend), seed,
                                       first["llm_layer"], n_llm, recompute.llm_full_layers, recompute.llm_selective)
        if n_llm:
            self.rotary = RotaryEmbedding(kv_channels=spec.language.kv_channels, rotary_percent=1.0, rotary_base=spec.language.rotary_base,
                                          use_cpu_initialization=True)
        if first["llm_head"] is not None:
            with seeded(seed, first["llm_head"]):
                norm = get_gpt_layer_local_spec(normalization=spec.language.normalization).submodules.input_layernorm
                self.head = OutputHead(spec, llm_config, norm)
        # Tied input/output embeddings: on a stage holding both E and L the head's output layer uses the
        # embedding's Parameter itself; on the last stage without E the head holds a copy drawn exactly as
        # the embedding is (the llm.embed unit's seed), kept equal by summing the two copies' gradients
        # over ``tied_group`` (allreduce_tied_embedding_grads, before the data-parallel reduction) and
        # marked ``shared`` so the gradient norm counts the weight once.
        self.tied_group = None  # set by megatron.training.training.build_model when E and L are apart
        if spec.language.tie_word_embeddings and self.head is not None:
            if self.text_embed is not None:
                self.head.output.weight = self.text_embed.word.weight
            else:
                embed_index = next(u.index for u in units if u.kind == "llm_embed")
                with seeded(seed, embed_index):
                    drawn = word_embedding(spec, llm_config)
                with torch.no_grad():
                    self.head.output.weight.copy_(drawn.weight)
                self.head.output.weight.shared = True

    def _blocks(self, base, normalization, mask_type, seed, first_index, n_layers, full_layers, selective,
                real_heads=None, vision=None):
        blocks = torch.nn.ModuleList()
        offset = 0
        for n, cfg in segment_configs(base, n_layers, min(full_layers, n_layers), selective):
            layer = _layer_spec(normalization, mask_type, seed, first_index + offset, self.transformer_impl,
                                self.attention_backend, real_heads, vision)
            blocks.append(TransformerBlock(cfg, layer, post_layer_norm=False))
            offset += n
        return blocks

    def tied_embedding_weight(self):
        """This stage's copy of the tied embedding / output weight (None when untied or neither is here)."""
        if not self.spec.language.tie_word_embeddings:
            return None
        if self.text_embed is not None:
            return self.text_embed.word.weight
        return self.head.output.weight if self.head is not None else None

    def allreduce_tied_embedding_grads(self) -> None:
        """Sum the tied weight's gradient over the stages holding E and L (``tied_group``), so both copies
        take the same step. Runs before megatron's finalize_model_grads (the DP reduction), on the local
        accumulated gradients, which is right for the plain and the distributed optimizer alike."""
        if self.tied_group is None:
            return
        weight = self.tied_embedding_weight()
        grad = getattr(weight, "main_grad", None)
        if grad is None:
            grad = weight.grad
        torch.distributed.all_reduce(grad, group=self.tied_group)

    def unit_modules(self):
        """(unit, module, where the module sits in this stage's state dict) for each unit of the stage."""
        singles = {"vit_embed": ("vit_embed", self.vit_embed), "projector": ("projector", self.projector),
                   "llm_embed": ("text_embed", self.text_embed), "llm_head": ("head", self.head)}
        layers = {"vit_layer": self._layer_paths(self.vit_blocks, "vit_blocks"),
                  "llm_layer": self._layer_paths(self.llm_blocks, "llm_blocks")}
        for unit in self.units:
            path, module = singles[unit.kind] if unit.kind in singles else next(layers[unit.kind])
            yield unit, module, f"{path}."

    @staticmethod
    def _layer_paths(blocks, name: str):
        for b, block in enumerate(blocks):
            for j, layer in enumerate(block.layers):
                yield f"{name}.{b}.layers.{j}", layer

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """megatron-core sharded state dict whose checkpoint keys are the global unit names (see
        megatron/vlm/sharding.py): independent of stage, recompute segmentation, layout and TP size."""
        from megatron.vlm.sharding import drop_padded_heads, unit_sharded_state_dict

        if sharded_offsets:
            raise ValueError("VLMStage.sharded_state_dict: units carry global names; no offsets apply")
        vit_cfg = self.vit_blocks[0].config if len(self.vit_blocks) else None
        sd = {}
        for unit, module, path in self.unit_modules():
            unit_sd = unit_sharded_state_dict(module, prefix + path, f"{unit.name}.", metadata)
            if unit.kind == "vit_layer":
                tp = vit_cfg.tensor_model_parallel_size
                drop_padded_heads(unit_sd, prefix + path, self.spec.vision.num_attention_heads,
                                  vit_cfg.num_attention_heads // tp,
                                  parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0,
                                  vit_cfg.kv_channels)
            sd.update(unit_sd)
        return sd

    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def llm_context(self, batch: dict) -> dict:
        """What the LLM blocks take besides the hidden states, built once per micro-batch.

        THD: ``packed_seq_params`` from the host-built ``cu_seqlens`` (kept on the host for the local
        spec, where SegmentAttention and megatron-core's unfused RoPE read them; on the device for
        TransformerEngine) and RoPE frequencies for ``max_seqlen`` positions, which megatron-core's
        ``apply_rotary_pos_emb`` restarts in every segment.  Dense (unfused): the block-diagonal mask
        [b, 1, s, s] and per-token frequencies [s, b, 1, d] gathered at ``position_ids``.
        """
        max_seqlen = int(batch["max_seqlen"])
        if self.thd:
            device = next(self.parameters()).device if self.transformer_impl == "transformer_engine" else None
            params = segment_params(batch["cu_seqlens"], max_seqlen, device)
            t = params.segments[-1][1]  # tokens of the micro-batch (tokens are only where the embedding is)
            # megatron-core maps frequencies by absolute offset when there are exactly t of them (and reads
            # each segment's start with .item()); one more keeps it on the restart-per-segment mapping
            rope = self.rotary(max_seqlen + 1 if max_seqlen == t else max_seqlen)
            return {"attention_mask": None, "rotary_pos_emb": rope, "packed_seq_params": params}
        rope = self.rotary(max_seqlen)[:, 0][batch["position_ids"].transpose(0, 1)]
        return {"attention_mask": packed_causal_mask(batch["segment_ids"]), "rotary_pos_emb": rope}

    def run_llm(self, x: torch.Tensor, context: dict, blocks=None) -> torch.Tensor:
        """The LLM blocks (default: all of this stage's) on x [b * s, 1, H] -> [b * s, 1, H]."""
        blocks = self.llm_blocks if blocks is None else blocks
        if self.thd:
            for block in blocks:
                x = block(hidden_states=x, **context)
            return x
        b, s = context["attention_mask"].shape[0], context["attention_mask"].shape[-1]
        x = x.reshape(b, s, -1).transpose(0, 1)  # [s, b, H]: DotProductAttention's layout
        for block in blocks:
            x = block(hidden_states=x, **context)
        return x.transpose(0, 1).reshape(b * s, 1, -1)

    def forward(self, batch: dict) -> torch.Tensor:
        """The stage's slice of the model: the next stage's input, or per-token loss [b, s] at the end."""
        x = None if self.vit_embed is not None else self.input_tensor
        if self.vit_embed is not None:
            x = self.vit_embed(batch["pixel_values"])
        for block in self.vit_blocks:
            x = block(hidden_states=x, attention_mask=None)
        if self.projector is not None:
            x = self.projector(x)
        if self.text_embed is not None:
            x = self.text_embed(batch["tokens"], x, batch["image_tile_index"])
        if self.llm_blocks:
            x = self.run_llm(x, self.llm_context(batch))
        if self.head is not None:
            return self.head(x, batch["labels"])
        # megatron-core frees a sent stage output's storage (deallocate_pipeline_outputs), which a view of
        # another tensor (the projector's unsqueeze, a reshape) cannot give up
        return make_viewless_tensor(x, requires_grad=x.requires_grad, keep_graph=True)

