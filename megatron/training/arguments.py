"""Command-line arguments: Megatron's flags for what exists here, plus ``--omnibal-*``.

Everything that can be wrong with the flags is checked in :func:`validate_args`, before any
process group, model or data is built.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os

from omnibal_ext.errors import UserError
from omnibal_ext.model.cost_model import DEVICES
from omnibal_ext.model.sample_time import ISF_TIME_DEVICE
from omnibal_ext.model.layout import parse_layout
from omnibal_ext.model.trainable import add_freeze_flags, trainable_of
from omnibal_ext.model.spec import vit_layers_for_feature_layer
from omnibal_ext.model.units import PRESETS, ModelSpec, build_units, default_model, family_of, get_preset
from omnibal_ext.plan import tp_problem, trainer_argv

from megatron.vlm.families import import_family_modules as import_modules  # importing it registers the built-ins


class ArgumentError(UserError):
    """A flag value that cannot work; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a VLM (ViT -> projector -> LLM) with 3D parallelism and OmniBal.",
        allow_abbrev=False)

    g = p.add_argument_group("model")
    g.add_argument("--family-module", action="append", default=[], metavar="MODULE",
                   help="import MODULE (a module name or a path to a .py file) before the flags are parsed "
                        "(repeatable): a model family defined outside this repository that registers itself with "
                        "megatron.vlm.families.register() when imported; its presets and --hf-checkpoint configs "
                        "become known")
    g.add_argument("--model", default=default_model(), choices=sorted(PRESETS), help="model size preset")
    g.add_argument("--hf-checkpoint", default=None, metavar="DIR",
                   help="start from this Hugging Face folder (config.json + *.safetensors of a registered family: "
                        "the one whose reader recognizes its config.json): the model comes from its config.json (no "
                        "model flags needed; a model flag that disagrees is an error), each rank loads its own units and TP "
                        "slices "
                        "from the safetensors, and a tokenizer there is the default --tokenizer-model")
    for flag, help_ in [
        ("--vision-num-layers", "ViT layers"), ("--vision-hidden-size", "ViT hidden size"),
        ("--vision-num-attention-heads", "ViT heads"), ("--vision-ffn-hidden-size", "ViT MLP size"),
        ("--image-size", "tile side in pixels"), ("--patch-size", "ViT patch side in pixels"),
        ("--num-layers", "LLM layers"), ("--hidden-size", "LLM hidden size"),
        ("--num-attention-heads", "LLM heads"), ("--num-query-groups", "LLM key/value heads"),
        ("--ffn-hidden-size", "LLM MLP size"),
    ]:
        g.add_argument(flag, type=int, default=None, help=f"{help_} (default: the preset's)")

    g.add_argument("--init-method-std", type=float, default=None, help="weight init std (default: the preset's)")
    B = argparse.BooleanOptionalAction
    g.add_argument("--vision-normalization", choices=["LayerNorm", "RMSNorm"], default=None,
                   help="ViT norm type (default: the preset's)")
    g.add_argument("--vision-norm-eps", type=float, default=None, help="ViT norm epsilon (default: the preset's)")
    g.add_argument("--vision-qkv-bias", action=B, default=None, help="bias on the ViT's QKV (default: the preset's)")
    g.add_argument("--vision-qk-norm", action=B, default=None,
                   help="RMSNorm of q and k over the full width of all ViT heads (default: the preset's)")
    g.add_argument("--vision-layer-scale-init", default=None,
                   help="ViT layer scale start value, or 'none' for no layer scale (default: the preset's)")
    g.add_argument("--vision-feature-layer", type=int, default=-1,
                   help="HF vision_feature_layer: build the ViT up to this layer of --vision-num-layers "
                        "(-1: all; -k: all but the last k-1; k >= 1: the first k)")
    g.add_argument("--qkv-bias", action=B, default=None, help="bias on the LLM's q, k, v (Qwen2; default: the preset's)")
    g.add_argument("--head-dim", type=int, default=None, help="LLM per-head width (default: hidden / heads)")
    g.add_argument("--norm-epsilon", type=float, default=None, help="LLM RMSNorm epsilon (default: the preset's)")
    g.add_argument("--rotary-base", type=int, default=None, help="LLM RoPE theta (default: the preset's)")
    g.add_argument("--tie-word-embeddings", action=B, default=None,
                   help="output layer shares the input embedding's weight (default: the preset's)")

    add_moe_flags(p)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="megatron-core sequence parallelism in the ViT and LLM layers (needs TP > 1): norms, "
                        "layer scale and dropout run on 1/TP of the tokens, the TP all-reduces become "
                        "all-gather/reduce-scatter; LLM rows are padded to a multiple of TP, ViT tiles' tokens "
                        "too (the pads masked out of attention); megatron-core's torch layers only")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each packed sample of the LLM over this many ranks (2 x CP chunks per sample, "
                        "balanced for causal attention; keys/values all-gathered per layer); the ViT's tiles are "
                        "divided over the same ranks (megatron/vlm/parallel/context_parallel.py)")
    g.add_argument("--pipeline-layout", default=None,
                   help="units per stage, e.g. 'Iv*3|vPEt*4L' (I vit embed, v ViT layer, P projector, "
                        "E LLM embed, t LLM layer, L head) or counts '4,8'; default: Megatron's "
                        "(ViT + projector on stage 0, LLM layers uniform); V x PP stages make an interleaved "
                        "pipeline: stage i runs on pipeline rank i mod PP as its model chunk i div PP")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None, metavar="V",
                   help="model chunks per pipeline rank (megatron-core's interleaved 1F1B schedule); default: "
                        "--pipeline-layout's stages / PP, else 1; needs micro-batches per pipeline >= PP and a "
                        "multiple of PP")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda+NCCL when a GPU is visible, else cpu+gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="how long a collective or p2p transfer waits for the other ranks before it fails with an "
                        "error (every process group: torch.distributed's, megatron-core's and ours); a rank that "
                        "stalls then stops the run instead of hanging it")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap the data-parallel gradient reduction with the backward pass (megatron-core "
                        "DDP buckets); default: on for CUDA runs, off on CPU")
    g.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap the distributed optimizer's parameter all-gather with the next forward "
                        "(needs --use-distributed-optimizer); default: on for CUDA runs with "
                        "--use-distributed-optimizer, off on CPU")
    g.add_argument("--transformer-impl", choices=["auto", "local", "transformer_engine"], default="auto",
                   help="layer implementation: auto = TransformerEngine on CUDA when importable and the "
                        "LLM runs packed sequences (THD, i.e. not --attention-backend unfused), else "
                        "megatron-core's torch modules (always on CPU)")
    g.add_argument("--attention-backend", choices=["auto", "unfused"], default="auto",
                   help="core attention of the torch layers: auto = packed sequences (THD), attention "
                        "within each sample (torch SDPA, cost sum of squared sample lengths, scores not kept); unfused = "
                        "megatron-core's DotProductAttention with a dense block-diagonal mask (scores kept, "
                        "so selective recompute has something to save)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4,
                   help="samples per micro-batch (with --omnibal-isf: target samples per packed group)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration (default: 4 micro-batches per data-parallel rank)")
    g.add_argument("--train-iters", type=int, default=1500)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-5)
    g.add_argument("--vision-lr", type=float, default=None,
                   help="peak learning rate of the ViT (default --lr); follows the LR schedule, its minimum scaled alike")
    g.add_argument("--projector-lr", type=float, default=None,
                   help="peak learning rate of the projector (default --lr); follows the LR schedule like --vision-lr")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="iterations the LR decays over, from --lr to --min-lr (default: --train-iters); give it to "
                        "keep a run's schedule when a resume trains longer")
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on resume: this run's LR schedule flags (--lr, --min-lr, --lr-warmup-iters, "
                        "--lr-decay-iters, --lr-decay-style, --weight-decay) replace the checkpoint's; the schedule "
                        "continues from the checkpoint's step")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on resume: keep the checkpoint's LR schedule, whatever these flags say (without either "
                        "flag a resume whose schedule flags differ from the checkpoint's is refused, as in "
                        "Megatron-LM)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
                   help="do not stop the run when the loss or a gradient is NaN or Inf (checked on every rank "
                        "before each optimizer step by default, as in Megatron-LM)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations (GPU)")
    g.add_argument("--loss-reduction", choices=["token", "sample", "square"], default="token",
                   help="weight of a sample's answer tokens in a global batch's loss (as VLM fine-tuning defines "
                        "them): token = every answer token the same, sample = every sample the same (1/n per token), "
                        "square = "
                        "1/sqrt(n) per token of a sample with n answer tokens; normalised over the whole global "
                        "batch, so it depends on neither DP, micro-batch size, packing nor PP")
    g.add_argument("--vision-drop-path-rate", type=float, default=0.0,
                   help="ViT stochastic depth: branches dropped per tile with a rate rising linearly over the "
                        "layers to this value (the published ViTs' drop_path_rate); the mask is hashed from (seed, "
                        "iteration, sample, tile, layer), so any TP/PP/DP/layout gives the serial run's losses")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="the same recompute on every stage (full: every layer)")
    g.add_argument("--recompute-plan", default=None,
                   help="per-stage recompute, e.g. 'v2s,t3|t0s': per stage vN = first N ViT layers full, "
                        "tN = first N LLM layers full, trailing s = selective for the others")
    add_freeze_flags(p)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=None,
                   help="meta JSON, or one annotation JSONL (conversations or messages records); default: "
                        "the built-in digits dataset, made on first run")
    g.add_argument("--valid-data-path", default=None,
                   help="meta JSON or annotation JSONL for evaluation (default: the built-in dataset's held-out split)")
    g.add_argument("--data-cache-dir", default="data_cache",
                   help="where the built-in dataset is written and the validation scans of datasets are kept "
                        "(scans/: a restart of the same data reads its scan instead of decoding every image again)")
    g.add_argument("--tokenizer-model", default=None, help="local Hugging Face tokenizer folder (default: byte-level)")
    g.add_argument("--max-num-tiles", type=int, default=6, help="most tiles per image, thumbnail excluded")
    g.add_argument("--min-num-tiles", type=int, default=1, help="fewest tiles per image (min_dynamic_patch)")
    g.add_argument("--min-pixels", type=int, default=None,
                   help="native-resolution images: fewest pixels (height x width) an image is resized to (default: the "
                        "--hf-checkpoint folder's preprocessor_config.json, else 3136)")
    g.add_argument("--max-pixels", type=int, default=None,
                   help="native-resolution images: most pixels an image is resized to (default: the folder's "
                        "preprocessor_config.json, else 1003520)")
    g.add_argument("--video-fps", type=float, default=None,
                   help="videos: frames sampled per second of source (default: the --hf-checkpoint folder's "
                        "video_preprocessor_config.json, else 2); refused by a family that samples a frame count")
    g.add_argument("--video-min-frames", type=int, default=None,
                   help="videos: fewest frames sampled (default: the folder's file, else the family's processor's)")
    g.add_argument("--video-max-frames", type=int, default=None,
                   help="videos: most frames sampled (default: the folder's file, else the family's processor's); "
                        "alone below the minimum it lowers the minimum")
    g.add_argument("--video-max-pixels", type=int, default=None,
                   help="videos: most pixels (height x width) each frame is resized to, for a family whose video "
                        "processor caps frames (its size.longest_edge)")
    g.add_argument("--video-total-pixels", type=int, default=None,
                   help="videos: most pixels of a whole video (frames x height x width), for a family whose video "
                        "processor budgets videos (its size.longest_edge)")
    g.add_argument("--video-folder-fps", type=float, default=24.0,
                   help="videos: the frame rate given to a frame folder (a directory of images), which has none")
    g.add_argument("--seq-length", type=int, default=512, help="longest sample in tokens")
    g.add_argument("--skip-bad-samples", action="store_true",
                   help="leave out records that fail the pre-training scan (missing or undecodable image, bad "
                        "JSON or conversation, too long) instead of stopping: each is listed with file:line and "
                        "its reason in DATA_CACHE_DIR/skipped/<meta name>-<path hash>.txt and counted in the log")
    g.add_argument("--max-skipped-fraction", type=float, default=0.1,
                   help="with --skip-bad-samples: stop before training when more than this fraction of a data "
                        "file's records fail the scan (a wrong image root, say)")
    g.add_argument("--truncate-long-samples", action="store_true",
                   help="cut a sample longer than --seq-length at that length (an image block is never split: "
                        "images that do not fit are dropped with their tokens) instead of stopping")
    g.add_argument("--num-workers", type=int, default=0,
                   help="data-loader worker processes of each rank that decodes images (0: load in the training "
                        "process); only the TP rank 0 of a stage with the ViT embedding decodes, and broadcasts "
                        "to its TP group; stages without it read no image and load in the training process")
    g.add_argument("--prefetch-factor", type=int, default=2,
                   help="micro-batches each data-loader worker prepares ahead (with --num-workers > 0)")

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--eval-interval", type=int, default=200, help="evaluate every N iterations (and at the end); 0: never")
    g.add_argument("--eval-iters", type=int, default=None,
                   help="iterations (global batches) per evaluation (default: one pass over the validation set)")
    g.add_argument("--eval-generate", action="store_true",
                   help="at each evaluation also generate every answer of the evaluated validation samples (greedy, on "
                        "the training layout) and log the accuracy by generation beside the teacher-forced one, with "
                        "the samples where they differ counted by cause (docs/generation.md)")
    g.add_argument("--eval-generate-samples", type=int, default=None, metavar="N",
                   help="with --eval-generate: the first N evaluated samples only (default: all)")
    g.add_argument("--save", default=None, help="checkpoint folder (saved at --save-interval and at the end)")
    g.add_argument("--load", default=None,
                   help="resume from the newest complete checkpoint here, at any TP/PP/DP and layout (none there: "
                        "start from scratch; `--save X --load X` under torchrun --max-restarts resumes a killed job)")
    g.add_argument("--ckpt-step", type=int, default=None, help="with --load: that iteration's checkpoint")
    g.add_argument("--keep-checkpoints", type=int, default=None,
                   help="keep the newest N checkpoints of this run's lineage, and always the one the tracker names "
                        "(default: all)")
    g.add_argument("--force-save-lock", action="store_true",
                   help="take over the --save folder's lock even when another host holds it (its run cannot be "
                        "judged dead from here: make sure it is); a dead process of this host is taken over without it")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end of training; 0: only at the end)")
    g.add_argument("--exit-interval", type=int, default=None, help="stop (after saving) at this iteration (0: run all --train-iters)")
    g.add_argument("--json-log", default=None, help="write per-iteration metrics as JSON lines here")
    g.add_argument("--log-activation-memory", action="store_true",
                   help="measure saved-activation bytes per stage (on with --omnibal-recompute auto)")

    g = p.add_argument_group("omnibal")
    g.add_argument("--omnibal-isf", action="store_true", help="ISF data balancing: one packed group per micro-batch")
    g.add_argument("--omnibal-isf-qv", type=int, default=None,
                   help="ViT item cap per group: tiles, or patches at native resolution, where the groups are "
                        "balanced in predicted time and the caps are hard caps (default: searched)")
    g.add_argument("--omnibal-isf-qt", type=int, default=None,
                   help="LLM token cap per group (in time: a hard cap; default: searched)")
    g.add_argument("--omnibal-isf-qv-min", type=int, default=None, help="ISF lower bound Q'v (default 90%% of Qv; unused in time)")
    g.add_argument("--omnibal-isf-qt-min", type=int, default=None, help="ISF lower bound Q't (default 90%% of Qt; unused in time)")
    g.add_argument("--omnibal-isf-iters", type=int, default=None, metavar="T",
                   help="ISF passes T with fixed thresholds (default 10; `omnibal plan` writes its searched T for a plan "
                        "in time)")
    g.add_argument("--omnibal-isf-vit-time", type=int, default=None, metavar="NS",
                   help="in time (native resolution): cap on a group's predicted ViT time, ns of the cost model on "
                        "--omnibal-isf-time-device at this TP (needs --omnibal-isf-qv/-qt, the hard count caps; "
                        "`omnibal plan` writes it; default: searched)")
    g.add_argument("--omnibal-isf-llm-time", type=int, default=None, metavar="NS",
                   help="in time: cap on a group's predicted LLM time, ns (with --omnibal-isf-vit-time)")
    g.add_argument("--omnibal-isf-vit-time-min", type=int, default=None, metavar="NS",
                   help="in time: lower bound of a kept group's ViT time, ns (default 90%% of the cap)")
    g.add_argument("--omnibal-isf-llm-time-min", type=int, default=None, metavar="NS",
                   help="in time: lower bound of a kept group's LLM time, ns (default 90%% of the cap)")
    g.add_argument("--omnibal-isf-time-device", choices=sorted(DEVICES), default=ISF_TIME_DEVICE,
                   help="cost-model device of the samples' predicted times (ISF in time, the logged Dist ratios in "
                        f"time; default {ISF_TIME_DEVICE}; `omnibal plan` writes its --device)")
    g.add_argument("--omnibal-isf-token-multiple", type=int, default=None, metavar="N",
                   help="ISF counts each sample's tokens rounded up to a multiple of N, so Qt caps and the step "
                        "assembly balances the padded tokens (default: what --context-parallel-size pads a sample "
                        "to, 2 x CP, x TP with --sequence-parallel; 1 without CP); give it to a run without CP to "
                        "group as a CP run does")
    g.add_argument("--omnibal-partition", choices=["none", "auto"], default="none",
                   help="auto: profile (or read --omnibal-profile), search and apply a balanced layout")
    g.add_argument("--omnibal-profile", default=None,
                   help="profile JSON to read for --omnibal-partition/--omnibal-recompute auto; with neither, "
                        "profile the units, write this file and exit")
    g.add_argument("--omnibal-recompute", choices=["none", "auto"], default="none",
                   help="auto: least recompute per stage that fits --omnibal-memory-budget")
    g.add_argument("--omnibal-memory-budget", type=float, default=None, help="GiB per device")
    g.add_argument("--omnibal-plan", default=None, help="plan JSON from `omnibal plan` to apply")
    return p


def add_moe_flags(p) -> None:
    """Mixture-of-experts LLM layers (Megatron's flag names): the built-in models' experts and how they train."""
    g = p.add_argument_group("mixture of experts (the built-in models' LLM; megatron-core's MoELayer)")
    g.add_argument("--num-experts", type=int, default=None,
                   help="routed experts per MoE layer (default: none, a dense LLM)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="one expert's FFN width (default: --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", default="1",
                   help="which LLM layers are MoE: an integer N (layer i when i %% N == 0) or a list of 0/1 per "
                        "layer, e.g. '[1,0,1,1]' (megatron-core's two forms)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN width of a shared expert every token goes through (default: none)")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="the shared expert's output through a sigmoid gate (a linear H -> 1)")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax",
                   help="the router's score (sigmoid: DeepSeek-V3's, renormalised over the top k)")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax router: the softmax over all experts, then the top k (their probabilities not "
                        "renormalised: HF norm_topk_prob False); default: softmax over the top-k logits")
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "none"],
                   default="aux_loss",
                   help="load-balancing loss: aux_loss per micro-batch, seq_aux_loss per packed sample (padding "
                        "excluded), global_aux_loss over the global batch, or none")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="weight of the load-balancing loss")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="weight of the router z-loss (default: none)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert routing bias moved towards balance every iteration "
                        "(needs --moe-router-score-function sigmoid)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="step of the expert bias per iteration (with --moe-router-enable-expert-bias)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="tokens an expert takes, x its even share (default: no dropping)")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs",
                   help="with --moe-expert-capacity-factor: drop the lowest-probability or the latest tokens")
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather"], default="alltoall",
                   help="how tokens reach the experts of other expert-parallel ranks: alltoall, or megatron-core's "
                        "all-gather over the expert TP x EP group (each rank's tokens padded to the group's largest "
                        "count, the pads routed to no expert)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert-parallel ranks (EP): each holds num-experts / EP experts; the experts' grid is "
                        "ETP x EP x expert-DP x PP over the same world (expert DP = world / (ETP x EP x PP))")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor-parallel size of each expert (ETP; default: --tensor-model-parallel-size)")
    g.add_argument("--log-expert-load", default=None, metavar="FILE",
                   help="write each iteration's tokens per expert per MoE layer (all ranks') as JSON lines here")


MOE_FLAGS = ("--moe-router-topk", "--moe-ffn-hidden-size", "--moe-layer-freq", "--moe-shared-expert-intermediate-size",
             "--moe-shared-expert-gate", "--moe-router-score-function", "--moe-router-pre-softmax",
             "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-z-loss-coeff",
             "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "--moe-expert-capacity-factor",
             "--moe-token-drop-policy", "--moe-token-dispatcher-type", "--expert-model-parallel-size",
             "--expert-tensor-parallel-size", "--log-expert-load")


def moe_spec_from_args(args, num_layers: int, ffn_hidden_size: int):
    """The experts the flags describe (``omnibal_ext.model.moe.MoESpec``), None without --num-experts; the MoE flags
    without --num-experts are refused, naming them."""
    from omnibal_ext.model.moe import MoESpec, parse_layer_freq

    if args.num_experts is None:
        defaults = build_parser()
        given = [f for f in MOE_FLAGS if getattr(args, f[2:].replace("-", "_")) != defaults.get_default(f[2:].replace("-", "_"))]
        if given:
            raise ArgumentError(f"{', '.join(given)}: MoE flag(s) without --num-experts (a dense LLM); give "
                                "--num-experts or drop them")
        return None
    for flag, value in (("--num-experts", args.num_experts), ("--moe-router-topk", args.moe_router_topk),
                        ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size)):
        if value is not None and value < 1:
            raise ArgumentError(f"{flag} {value}: must be >= 1")
    if args.moe_router_topk > args.num_experts:
        raise ArgumentError(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {args.num_experts}")
    try:
        freq = parse_layer_freq(args.moe_layer_freq, num_layers)
        return MoESpec(num_experts=args.num_experts, topk=args.moe_router_topk,
                       ffn_hidden_size=args.moe_ffn_hidden_size or ffn_hidden_size, layer_freq=freq,
                       shared_expert_ffn_hidden_size=args.moe_shared_expert_intermediate_size or 0,
                       shared_expert_gate=args.moe_shared_expert_gate,
                       norm_topk_prob=not args.moe_router_pre_softmax, score_function=args.moe_router_score_function,
                       load_balancing_type=args.moe_router_load_balancing_type,
                       capacity_factor=args.moe_expert_capacity_factor)
    except ArgumentError:
        raise
    except UserError as e:
        message = str(e)
        flag = "--moe-layer-freq" if "layer_freq" in message or "--moe-layer-freq" in message else "--num-experts"
        raise ArgumentError(message if message.startswith("--") else f"{flag}: {message}") from None


def check_moe(args, spec: ModelSpec, tp: int, pp: int, cp: int, dp: int) -> None:
    """The MoE flags against each other and megatron-core's expert grid (naming the flag)."""
    from omnibal_ext.model.moe import ExpertGrid, expert_grid_problem

    moe = spec.language.moe
    if moe is None:
        if getattr(args, "hf_checkpoint", None):  # a dense checkpoint: no MoE flag applies
            defaults = build_parser()
            given = [f for f in ("--num-experts", *MOE_FLAGS)
                     if getattr(args, f[2:].replace("-", "_")) != defaults.get_default(f[2:].replace("-", "_"))]
            if given:
                raise ArgumentError(f"{', '.join(given)} with --hf-checkpoint {args.hf_checkpoint}: its LLM is dense "
                                    "(config.json names no experts); drop them")
        return
    if args.moe_router_pre_softmax and args.moe_router_score_function != "softmax":
        raise ArgumentError("--moe-router-pre-softmax is the softmax router's (the sigmoid router always "
                            "renormalises its top-k scores): drop it or use --moe-router-score-function softmax")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        raise ArgumentError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                            "(megatron-core's aux-loss-free balancing)")
    if args.moe_router_enable_expert_bias and args.freeze_llm:
        raise ArgumentError("--moe-router-enable-expert-bias with --freeze-llm: the expert bias is the router's "
                            "state, which a frozen LLM keeps, but megatron-core updates it every step; drop one")
    if args.moe_aux_loss_coeff < 0 or (args.moe_z_loss_coeff is not None and args.moe_z_loss_coeff < 0):
        raise ArgumentError("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
    from omnibal_ext.model.lora import Lora

    lora = Lora.from_args(args)
    mlp = [t for t in lora.targets if t in ("llm.fc1", "llm.fc2")] if lora.on else []
    if mlp:
        raise ArgumentError(f"--lora-targets {','.join(mlp)} (the default targets include them) with --num-experts: "
                            "adapters on experts (llm.experts) are not supported yet; give --lora-targets "
                            "llm.qkv,llm.proj (and ViT targets)")
    if tp > 1 and not args.sequence_parallel:
        raise ArgumentError(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
                            "(megatron-core's MoELayer refuses to train under TP without it)")
    if args.transformer_impl == "transformer_engine":
        raise ArgumentError("--num-experts runs megatron-core's local MoE (SequentialMLP): use --transformer-impl "
                            "local or auto")
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    if ep < 1 or etp < 1:
        raise ArgumentError("--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1")
    problem = expert_grid_problem(moe, ExpertGrid(ep, etp), tp, cp, dp)
    if problem:
        flag = "--expert-tensor-parallel-size" if problem.startswith(f"ETP {etp} does not divide the expert") \
            else "--expert-model-parallel-size"
        raise ArgumentError(f"{flag}: {problem} (--expert-model-parallel-size {ep}, --expert-tensor-parallel-size "
                            f"{etp}, world {tp * cp * dp * pp})")


def moe_run_of(args, spec: ModelSpec | None = None):
    """How the MoE layers train (``megatron.vlm.layers.moe.MoERun``) from checked flags; None for a dense model (``spec``,
    the model the flags describe: default ``model_spec_of(args)``)."""
    spec = model_spec_of(args) if spec is None else spec
    if spec.language.moe is None:
        return None
    from megatron.vlm.layers.moe import MoERun

    return MoERun(aux_loss_coeff=args.moe_aux_loss_coeff, z_loss_coeff=args.moe_z_loss_coeff,
                  expert_bias=args.moe_router_enable_expert_bias, bias_update_rate=args.moe_router_bias_update_rate,
                  drop_policy=args.moe_token_drop_policy, dispatcher=args.moe_token_dispatcher_type,
                  ep=args.expert_model_parallel_size,
                  etp=args.expert_tensor_parallel_size or args.tensor_model_parallel_size)


# dests of the flags that describe the model (besides --model)
MODEL_DESTS = ("vision_num_layers", "vision_hidden_size", "vision_num_attention_heads", "vision_ffn_hidden_size",
               "image_size", "patch_size", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
               "ffn_hidden_size", "init_method_std", "vision_normalization", "vision_norm_eps", "vision_qkv_bias",
               "vision_qk_norm", "vision_layer_scale_init", "vision_feature_layer", "qkv_bias", "head_dim",
               "norm_epsilon", "rotary_base", "tie_word_embeddings")


def hf_spec_from_args(args) -> ModelSpec:
    """--hf-checkpoint: the model of DIR/config.json; model flags given besides must agree with it."""
    from megatron.vlm.hf.configs import read_config, spec_from_config

    import os

    folder = args.hf_checkpoint
    if not os.path.isdir(folder):
        raise ArgumentError(f"--hf-checkpoint {folder}: no such folder")
    spec, _ = spec_from_config(read_config(folder), "hf:" + os.path.basename(os.path.normpath(folder)),
                               os.path.join(folder, "config.json"))
    parser = build_parser()
    if args.model != parser.get_default("model"):
        raise ArgumentError(f"--model {args.model} and --hf-checkpoint {folder} both name a model: drop --model")
    given = [d for d in MODEL_DESTS if getattr(args, d) != parser.get_default(d)]
    conflicts = []
    for d in given:
        if d == "vision_feature_layer":
            conflicts.append("--vision-feature-layer (config.json's vision_feature_layer applies)")
            continue
        probe = argparse.Namespace(**{k: parser.get_default(k) for k in MODEL_DESTS})
        setattr(probe, d, getattr(args, d))
        if model_spec_from_args(probe, base=spec) != spec:
            conflicts.append(f"--{d.replace('_', '-')} {getattr(args, d)}")
    conflicts += hf_moe_conflicts(args, spec.language.moe)
    if conflicts:
        raise ArgumentError(f"--hf-checkpoint {folder}: model flag(s) {', '.join(conflicts)} disagree with its "
                            "config.json; drop them (the model comes from the checkpoint)")
    if spec.language.moe is not None:  # what the checkpoint leaves to the run: the balancing loss, token dropping
        moe = dataclasses.replace(spec.language.moe, load_balancing_type=args.moe_router_load_balancing_type,
                                  capacity_factor=args.moe_expert_capacity_factor)
        spec = spec.replace(language=dataclasses.replace(spec.language, moe=moe))
    return spec


def hf_moe_conflicts(args, moe) -> list[str]:
    """The MoE flags a checkpoint's config.json fixes (the experts, routing, MoE layers, shared expert) that were
    given and disagree with ``moe`` (its MoESpec; None: a dense LLM, refused by ``check_moe``)."""
    from omnibal_ext.model.moe import parse_layer_freq

    if moe is None or not hasattr(args, "num_experts"):
        return []
    parser = build_parser()
    fixed = {"num_experts": moe.num_experts, "moe_router_topk": moe.topk, "moe_ffn_hidden_size": moe.ffn_hidden_size,
             "moe_shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size or None,
             "moe_shared_expert_gate": moe.shared_expert_gate, "moe_router_score_function": moe.score_function,
             "moe_router_pre_softmax": moe.score_function == "softmax" and not moe.norm_topk_prob}
    out = [f"--{d.replace('_', '-')} {getattr(args, d)}" for d, want in fixed.items()
           if getattr(args, d) != parser.get_default(d) and getattr(args, d) != want]
    if args.moe_layer_freq != parser.get_default("moe_layer_freq"):
        try:
            same = parse_layer_freq(args.moe_layer_freq, len(moe.layer_freq)) == moe.layer_freq
        except UserError:
            same = False
        if not same:
            out.append(f"--moe-layer-freq {args.moe_layer_freq}")
    return out


def model_spec_from_args(args, base: ModelSpec | None = None) -> ModelSpec:
    spec = base if base is not None else get_preset(args.model)
    vision_dests = [
        ("num_layers", "vision_num_layers"), ("hidden_size", "vision_hidden_size"),
        ("num_attention_heads", "vision_num_attention_heads"), ("ffn_hidden_size", "vision_ffn_hidden_size"),
        ("image_size", "image_size"), ("patch_size", "patch_size"), ("normalization", "vision_normalization"),
        ("norm_eps", "vision_norm_eps"), ("qkv_bias", "vision_qkv_bias"), ("qk_norm", "vision_qk_norm"),
        ("layer_scale_init", "vision_layer_scale_init")]
    fields = {f.name for f in dataclasses.fields(spec.vision)}
    for key, dest in vision_dests:  # a ViT setting the family's ViT does not have: refused, not ignored
        if key not in fields and getattr(args, dest, None) is not None:
            raise ArgumentError(f"--{dest.replace('_', '-')}: model family {spec.family}'s ViT "
                                f"({type(spec.vision).__name__}) has no {key!r} setting; drop the flag")
    v = {k: getattr(args, a) for k, a in vision_dests[:6] if getattr(args, a) is not None}
    lang = {k: getattr(args, a) for k, a in [
        ("num_layers", "num_layers"), ("hidden_size", "hidden_size"),
        ("num_attention_heads", "num_attention_heads"), ("num_query_groups", "num_query_groups"),
        ("ffn_hidden_size", "ffn_hidden_size")] if getattr(args, a) is not None}
    v.update({k: getattr(args, a) for k, a in [
        ("normalization", "vision_normalization"), ("norm_eps", "vision_norm_eps"), ("qkv_bias", "vision_qkv_bias"),
        ("qk_norm", "vision_qk_norm")] if getattr(args, a) is not None})
    scale = args.vision_layer_scale_init
    if scale is not None:
        if scale.lower() == "none":
            v["layer_scale_init"] = None
        else:
            try:
                v["layer_scale_init"] = float(scale)
            except ValueError:
                raise ArgumentError(f"--vision-layer-scale-init {scale!r}: a number or 'none'") from None
    lang.update({k: getattr(args, a) for k, a in [
        ("qkv_bias", "qkv_bias"), ("head_dim", "head_dim"), ("norm_eps", "norm_epsilon"),
        ("rotary_base", "rotary_base"), ("tie_word_embeddings", "tie_word_embeddings")]
        if getattr(args, a) is not None})
    feature_layer = args.vision_feature_layer
    if feature_layer != -1:
        n = v.get("num_layers", spec.vision.num_layers)
        try:
            v["num_layers"] = vit_layers_for_feature_layer(n, feature_layer)
        except UserError as e:
            raise ArgumentError(f"--vision-feature-layer: {e}") from None
    if hasattr(args, "num_experts"):  # the MoE flags (a probe of hf_spec_from_args has none)
        lang_now = dataclasses.replace(spec.language, **lang)
        moe = moe_spec_from_args(args, lang_now.num_layers, lang_now.ffn_hidden_size)
        if moe is not None:
            lang["moe"] = moe
    spec = spec.replace(vision=dataclasses.replace(spec.vision, **v), language=dataclasses.replace(spec.language, **lang))
    if args.init_method_std is not None:
        spec = spec.replace(init_method_std=args.init_method_std)
    return spec


# (flag, least value that can work; 0 turns an interval off): checked first, so that no division or loop
# of the run (all after the process groups start) meets them
_LOWER_BOUNDS = (
    ("--micro-batch-size", 1), ("--global-batch-size", 1), ("--train-iters", 0), ("--log-interval", 1),
    ("--eval-interval", 0), ("--eval-iters", 1), ("--save-interval", 0), ("--exit-interval", 0),
    ("--seq-length", 1), ("--max-num-tiles", 1), ("--min-num-tiles", 1), ("--num-workers", 0), ("--prefetch-factor", 1),
    ("--lr", 0), ("--min-lr", 0), ("--lr-warmup-iters", 0), ("--lr-decay-iters", 1), ("--weight-decay", 0),
    ("--clip-grad", 0), ("--adam-beta1", 0), ("--adam-beta2", 0), ("--max-skipped-fraction", 0),
    ("--omnibal-isf-qv", 1), ("--omnibal-isf-qt", 1), ("--omnibal-isf-qv-min", 0), ("--omnibal-isf-qt-min", 0),
    ("--omnibal-isf-token-multiple", 1), ("--omnibal-isf-iters", 1), ("--omnibal-isf-vit-time", 0),
    ("--omnibal-isf-llm-time", 1), ("--omnibal-isf-vit-time-min", 0), ("--omnibal-isf-llm-time-min", 0),
    ("--ckpt-step", 0), ("--keep-checkpoints", 1), ("--min-pixels", 1),
    ("--max-pixels", 1),
)
_ISF_VALUES = ("--omnibal-isf-qv", "--omnibal-isf-qt", "--omnibal-isf-qv-min", "--omnibal-isf-qt-min",
               "--omnibal-isf-token-multiple", "--omnibal-isf-iters", "--omnibal-isf-vit-time", "--omnibal-isf-llm-time",
               "--omnibal-isf-vit-time-min", "--omnibal-isf-llm-time-min")


def _flag_value(args, flag: str):
    return getattr(args, flag[2:].replace("-", "_"))


# (flag, bound it must stay below, or at most when the third entry is True)
_UPPER_BOUNDS = (("--adam-beta1", 1, False), ("--adam-beta2", 1, False), ("--max-skipped-fraction", 1, True))


def check_finite(args, parser: argparse.ArgumentParser) -> None:
    """Every float flag given is a finite number (argparse's ``float`` takes "nan" and "inf")."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.type is float and value is not None and not math.isfinite(value):
            raise ArgumentError(f"{action.option_strings[0]} {value}: must be a finite number")


def check_lower_bounds(args) -> None:
    """Every flag of ``_LOWER_BOUNDS`` that is given is at least its bound, and below its ``_UPPER_BOUNDS``."""
    for flag, most, inclusive in _UPPER_BOUNDS:
        value = _flag_value(args, flag)
        if value is not None and (value > most if inclusive else value >= most):
            raise ArgumentError(f"{flag} {value}: must be {'<=' if inclusive else '<'} {most}")
    for flag, least in _LOWER_BOUNDS:
        value = _flag_value(args, flag)
        if value is not None and value < least:
            raise ArgumentError(f"{flag} {value}: must be >= {least}")
    if args.min_num_tiles > args.max_num_tiles:
        raise ArgumentError(f"--min-num-tiles {args.min_num_tiles} > --max-num-tiles {args.max_num_tiles}")


def check_isf_flags(args) -> None:
    """--omnibal-isf-* need --omnibal-isf; the caps go together; each lower bound is at most its cap; the time
    thresholds need the count caps (their hard caps)."""
    given = [flag for flag in _ISF_VALUES if _flag_value(args, flag) is not None]
    if given and not args.omnibal_isf:
        raise ArgumentError(f"{' '.join(given)} given without --omnibal-isf: add --omnibal-isf or drop them")
    qv, qt = args.omnibal_isf_qv, args.omnibal_isf_qt
    if (qv is None) != (qt is None):
        raise ArgumentError("--omnibal-isf-qv and --omnibal-isf-qt go together (or give neither to search them)")
    vt, lt = args.omnibal_isf_vit_time, args.omnibal_isf_llm_time
    if (vt is None) != (lt is None):
        raise ArgumentError("--omnibal-isf-vit-time and --omnibal-isf-llm-time go together (or give neither to search "
                            "them)")
    if vt is not None and qv is None:
        raise ArgumentError("--omnibal-isf-vit-time/--omnibal-isf-llm-time need --omnibal-isf-qv/-qt (the hard count "
                            "caps the memory is planned for)")
    if args.omnibal_isf_iters is not None and qv is None:
        raise ArgumentError("--omnibal-isf-iters needs fixed thresholds (--omnibal-isf-qv/-qt); a search tries its own")
    for low_flag, low, cap_flag, cap in (("--omnibal-isf-qv-min", args.omnibal_isf_qv_min, "--omnibal-isf-qv", qv),
                                         ("--omnibal-isf-qt-min", args.omnibal_isf_qt_min, "--omnibal-isf-qt", qt),
                                         ("--omnibal-isf-vit-time-min", args.omnibal_isf_vit_time_min,
                                          "--omnibal-isf-vit-time", vt),
                                         ("--omnibal-isf-llm-time-min", args.omnibal_isf_llm_time_min,
                                          "--omnibal-isf-llm-time", lt)):
        if low is not None and cap is None:
            raise ArgumentError(f"{low_flag} {low} needs {cap_flag} (a lower bound of a fixed cap)")
        if low is not None and low > cap:
            raise ArgumentError(f"{low_flag} {low} is above {cap_flag} {cap}: a lower bound must not exceed its cap")


def check_schedule_flags(args) -> None:
    """The LR schedule's flags against each other (megatron-core's scheduler asserts them only after the data scan
    and the model build) and the two resume flags, which contradict each other."""
    if args.lr < args.min_lr:
        raise ArgumentError(f"--lr {args.lr} is below --min-lr {args.min_lr}: the schedule decays from --lr to "
                            f"--min-lr (give --min-lr {args.lr} or less)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each "
                            "other: give one (this run's schedule flags, or the checkpoint's schedule)")
    for flag, given in (("--override-opt_param-scheduler", args.override_opt_param_scheduler),
                        ("--use-checkpoint-opt_param-scheduler", args.use_checkpoint_opt_param_scheduler)):
        if given and not args.load:
            raise ArgumentError(f"{flag} needs --load (it says which LR schedule a resumed run follows)")


def check_run_safety_flags(args, parser: argparse.ArgumentParser) -> None:
    """Flags that only act with another (refused alone rather than ignored), and --tensorboard-dir's package."""
    if args.force_save_lock and not args.save:
        raise ArgumentError("--force-save-lock needs --save (it takes over the --save folder's lock)")
    if args.max_skipped_fraction != parser.get_default("max_skipped_fraction") and not args.skip_bad_samples:
        raise ArgumentError("--max-skipped-fraction needs --skip-bad-samples (without it any bad record stops the run)")
    if args.tensorboard_dir:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:  # torch.utils.tensorboard imports it
            raise ArgumentError(f"--tensorboard-dir {args.tensorboard_dir}: the tensorboard package is not installed "
                                "(pip install -e '.[tensorboard]', or drop the flag)")


def validate_args(args, world_size: int) -> None:
    """Check flags against each other and the world size; raise ArgumentError naming the flag."""
    parser = build_parser()
    check_finite(args, parser)
    check_lower_bounds(args)
    check_isf_flags(args)
    check_schedule_flags(args)
    check_run_safety_flags(args, parser)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ArgumentError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    spec = model_spec_of(args)
    check_capabilities(args, spec)  # first: a family's unit list refuses what it lacks (experts) less clearly
    n_units = len(build_units(spec))
    if pp > n_units:
        raise ArgumentError(
            f"--pipeline-model-parallel-size {pp} is larger than the model's {n_units} pipeline units "
            f"({spec.vision.num_layers} ViT layers + {spec.language.num_layers} LLM layers + embeddings, "
            f"projector and head): some stage would be empty")
    vpp = virtual_pipeline_size(args)  # checks the flag against the layout (LayoutError names --pipeline-layout)
    if args.transformer_impl == "transformer_engine" and args.attention_backend == "unfused":
        raise ArgumentError("--attention-backend unfused is megatron-core's DotProductAttention (a torch "
                            "module): use --transformer-impl local or auto with it")
    if args.sequence_parallel and (tp < 2 or args.transformer_impl == "transformer_engine"
                                   or args.attention_backend == "unfused"):
        raise ArgumentError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the tokens "
                            "over the TP ranks) and megatron-core's torch layers with --attention-backend auto")
    if not args.distributed_timeout_minutes > 0:
        raise ArgumentError(f"--distributed-timeout-minutes {args.distributed_timeout_minutes}: must be > 0")
    cp = args.context_parallel_size
    if cp < 1:
        raise ArgumentError(f"--context-parallel-size {cp}: must be >= 1")
    if cp > 1 and args.attention_backend == "unfused":
        raise ArgumentError("--context-parallel-size needs the packed-sequence attention (--attention-backend auto): "
                            "--attention-backend unfused is megatron-core's dense-mask DotProductAttention, which has "
                            "no context parallelism")
    if cp > 1 and args.transformer_impl == "transformer_engine":
        raise ArgumentError("--context-parallel-size with --transformer-impl transformer_engine is not supported yet: "
                            "use --transformer-impl local (SegmentAttention's all-gather context parallelism)")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer (it overlaps the "
                            "distributed optimizer's parameter all-gather)")
    dp = data_parallel_size(args, world_size)
    v, lang = spec.vision, spec.language
    if lang.head_dim is not None and lang.head_dim < 1:
        raise ArgumentError(f"--head-dim {lang.head_dim}: must be >= 1")
    for name, heads, hidden in [("--vision-num-attention-heads", v.num_attention_heads, v.hidden_size),
                                ("--num-attention-heads", lang.num_attention_heads, lang.hidden_size)]:
        if hidden % heads and not (name == "--num-attention-heads" and lang.head_dim):
            raise ArgumentError(f"{name} {heads} does not divide the hidden size {hidden}")
    if tp_problem(spec, tp):  # the planner's rule: the LLM's heads and groups divide, the ViT's are padded
        flag, value, what = (("--num-attention-heads", lang.num_attention_heads, "LLM attention heads")
                             if lang.num_attention_heads % tp else
                             ("--num-query-groups", lang.kv_groups, "LLM key/value groups"))
        raise ArgumentError(f"{flag} {value} ({what}) is not divisible by --tensor-model-parallel-size {tp}: "
                            f"each TP rank needs a whole share of them")
    problem = family_of(spec).spec_problem(spec)
    if problem:
        raise ArgumentError(problem)
    check_moe(args, spec, tp, pp, cp, dp)
    _, microbatches = batch_sizes(args, dp)
    if vpp > 1:
        check_interleaving(vpp, pp, microbatches, n_units)
        if args.omnibal_recompute == "auto":
            raise ArgumentError("--omnibal-recompute auto plans one model chunk per pipeline rank: it does not "
                                "support --virtual-pipeline-model-parallel-size > 1 (give --recompute-plan per stage)")
    if args.recompute_granularity and args.recompute_plan:
        raise ArgumentError("give either --recompute-granularity or --recompute-plan, not both")
    if args.omnibal_recompute == "auto" and (args.recompute_granularity or args.recompute_plan):
        raise ArgumentError("--omnibal-recompute auto chooses the recompute itself: drop --recompute-*")
    if args.omnibal_partition == "auto" and args.pipeline_layout:
        raise ArgumentError("--omnibal-partition auto chooses the layout itself: drop --pipeline-layout")
    if args.save_interval and not args.save:
        raise ArgumentError("--save-interval needs --save")
    check_eval_generate(args, vpp)
    if not 0.0 <= args.vision_drop_path_rate < 1.0:
        raise ArgumentError(f"--vision-drop-path-rate {args.vision_drop_path_rate}: must be in [0, 1)")
    if args.load and os.path.isfile(args.load):
        raise ArgumentError(f"--load {args.load} is a file: give the checkpoint folder (the one holding "
                            "latest_checkpointed_iteration.txt and iter_N/)")
    if args.ckpt_step is not None and not args.load:
        raise ArgumentError("--ckpt-step needs --load")
    trainable_of(args, spec)  # FreezeError/LoraError: flags that do not fit together or freeze everything
    check_lora(args, spec, tp)
    for flag, value in (("--vision-lr", args.vision_lr), ("--projector-lr", args.projector_lr)):
        if value is not None and value < 0:
            raise ArgumentError(f"{flag} {value}: must be >= 0")


def check_eval_generate(args, vpp: int) -> None:
    """--eval-generate runs generation on the training stages: one per rank, whose attention keeps a KV cache."""
    if args.eval_generate_samples is not None and (args.eval_generate_samples < 1 or not args.eval_generate):
        raise ArgumentError(f"--eval-generate-samples {args.eval_generate_samples}: must be >= 1, with --eval-generate")
    if not args.eval_generate:
        return
    if not args.eval_interval:
        raise ArgumentError("--eval-generate runs at each evaluation: give --eval-interval > 0")
    refused = [(args.context_parallel_size > 1, f"--context-parallel-size {args.context_parallel_size}"),
               (vpp > 1, "an interleaved pipeline (several model chunks per rank)"),
               (args.transformer_impl == "transformer_engine", "--transformer-impl transformer_engine"),
               (args.attention_backend == "unfused", "--attention-backend unfused")]
    for bad, what in refused:
        if bad:
            raise ArgumentError(f"--eval-generate with {what}: generation runs one stage per pipeline rank, its "
                                "attention megatron-core's torch layers with the packed-sequence attention (the one "
                                "that keeps a KV cache)")


# ``Capabilities`` field -> (flag, whether the flags ask for it): a family that does not declare the field refuses
# the flag (``check_capabilities``). Fields without a flag yet (no flag asks for them): ``UNFLAGGED_CAPABILITIES``.
CAPABILITY_FLAGS = {
    "drop_path": ("--vision-drop-path-rate", lambda args: args.vision_drop_path_rate > 0),
    "context_parallel": ("--context-parallel-size", lambda args: args.context_parallel_size > 1),
    "sequence_parallel": ("--sequence-parallel", lambda args: bool(args.sequence_parallel)),
    "moe": ("--num-experts", lambda args: getattr(args, "num_experts", None) is not None),
    "video": ("--video-*", lambda args: bool(video_flags_given(args))),
}
UNFLAGGED_CAPABILITIES = ()
IMAGE_FLAGS = ("--max-num-tiles", "--min-num-tiles", "--min-pixels", "--max-pixels")  # read by some image rules


def video_flags_given(args) -> tuple[str, ...]:
    """The ``--video-*`` flags given (``VideoOverrides.given``)."""
    from megatron.vlm.data.video_sampling import VideoOverrides

    return VideoOverrides.from_args(args).given()


def check_video_flags(args, spec: ModelSpec) -> None:
    """The family's video rule built from the flags (``DataSide.video_rule``): a flag its processor does not
    implement, or settings that do not fit together, are refused now, naming the flag."""
    from megatron.vlm.stage.components import runtime_family

    rule = runtime_family(spec).data.video_rule
    if rule is None:
        raise ArgumentError(f"{', '.join(video_flags_given(args))}: model family {spec.family} declares video but "
                            "its data side has no video rule")
    try:
        rule(args, spec, args.hf_checkpoint)
    except UserError as e:
        raise ArgumentError(str(e)) from None


def check_capabilities(args, spec: ModelSpec) -> None:
    """Refuse a flag that asks for what ``spec``'s family does not declare (``Family.capabilities``), naming the
    family and the flag: a flag is honoured or refused, never ignored."""
    from omnibal_ext.model.lora import Lora

    caps = family_of(spec).capabilities
    who = f"model family {spec.family}"
    for field, (flag, asked) in CAPABILITY_FLAGS.items():
        if asked(args) and not getattr(caps, field):
            if field == "video":
                flag = ", ".join(video_flags_given(args))
            raise ArgumentError(f"{flag}: {who} does not implement it (Capabilities.{field}); drop the flag")
    if caps.video and video_flags_given(args):
        check_video_flags(args, spec)
    lora = Lora.from_args(args)
    if lora.on:
        bad = [t for t in lora.targets if t not in caps.lora_targets]
        if bad:
            raise ArgumentError(f"--lora-targets {','.join(bad)}: {who} has no adapters there (it takes: "
                                f"{', '.join(caps.lora_targets) or 'none'})")
    defaults = build_parser()
    for flag in IMAGE_FLAGS:
        dest = flag[2:].replace("-", "_")
        if flag not in caps.image_flags and getattr(args, dest) != defaults.get_default(dest):
            raise ArgumentError(f"{flag}: {who}'s image rule does not read it (it reads: "
                                f"{', '.join(caps.image_flags) or 'no image flag'}); drop the flag")


def check_lora(args, spec: ModelSpec, tp: int) -> None:
    """LoRA runs on megatron-core's torch linears, and the ViT's attention adapters on unpadded heads."""
    from omnibal_ext.model.lora import Lora

    lora = Lora.from_args(args)
    if not lora.on:
        return
    if args.transformer_impl == "transformer_engine":
        raise ArgumentError("--lora-rank with --transformer-impl transformer_engine is not supported (TE fuses the "
                            "norm into qkv/fc1): use --transformer-impl local or auto")
    padded = spec.vision.padded_heads(tp) != spec.vision.num_attention_heads
    attention = [t for t in lora.targets if t in ("vit.qkv", "vit.proj")]
    if padded and attention:
        raise ArgumentError(f"--lora-targets {','.join(attention)}: the ViT's {spec.vision.num_attention_heads} heads "
                            f"are padded at --tensor-model-parallel-size {tp}; adapters on padded heads are not "
                            "supported (pick a TP size that divides the heads, or adapt vit.fc1/vit.fc2 only)")


def virtual_pipeline_size(args) -> int:
    """Model chunks per pipeline rank (V): --virtual-pipeline-model-parallel-size, else --pipeline-layout's
    stages / PP (Megatron's convention), else 1.  Raises ArgumentError/LayoutError when they disagree."""
    pp, given = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if given is not None and given < 1:
        raise ArgumentError(f"--virtual-pipeline-model-parallel-size {given}: must be >= 1")
    vpp = given or 1
    if args.pipeline_layout:
        vpp = parse_layout(args.pipeline_layout, model_spec_of(args), pp, vpp=given).num_stages // pp
    if vpp > 1 and pp < 2:
        raise ArgumentError(f"an interleaved pipeline ({vpp} model chunks per rank) needs "
                            "--pipeline-model-parallel-size >= 2")
    return vpp


def check_interleaving(vpp: int, pp: int, microbatches: int, n_units: int | None = None) -> None:
    """megatron-core's interleaved schedule needs micro-batches per pipeline >= PP and a multiple of PP."""
    if microbatches < pp or microbatches % pp:
        raise ArgumentError(
            f"interleaved pipeline ({vpp} model chunks per rank): megatron-core's schedule needs the micro-batches per "
            f"pipeline ({microbatches} = --global-batch-size / (--micro-batch-size x data-parallel size)) to be at "
            f"least and a multiple of --pipeline-model-parallel-size {pp}")
    if n_units is not None and vpp * pp > n_units:
        raise ArgumentError(f"interleaved pipeline: {vpp} model chunks x --pipeline-model-parallel-size {pp} "
                            f"stages but the model has only {n_units} pipeline units")


def model_spec_of(args) -> ModelSpec:
    """The model the flags describe: --hf-checkpoint's config.json, else the preset with the model flags
    (vocabulary not yet padded for the tokenizer)."""
    return hf_spec_from_args(args) if args.hf_checkpoint else model_spec_from_args(args)


def data_parallel_size(args, world_size: int) -> int:
    """world size / (TP x PP x CP); raises ArgumentError when it does not divide."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ArgumentError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}" + (f" x --context-parallel-size {cp}" if cp > 1 else ""))
    return world_size // (tp * pp * cp)


def batch_sizes(args, dp: int) -> tuple[int, int]:
    """(samples per iteration, micro-batches per iteration per data-parallel rank) for ``dp`` data-parallel
    ranks: --global-batch-size (default 4 micro-batches per rank) must be whole micro-batches on every rank."""
    mbs = args.micro_batch_size
    global_batch = 4 * mbs * dp if args.global_batch_size is None else args.global_batch_size
    if global_batch % (mbs * dp):
        raise ArgumentError(
            f"--global-batch-size {global_batch} is not divisible by --micro-batch-size {mbs} x "
            f"data-parallel size {dp}")
    return global_batch, global_batch // (mbs * dp)


def plan_flags(path: str) -> list[str]:
    """The trainer flags of a plan written by `omnibal plan` (its "trainer_flags")."""
    import json

    try:
        with open(path) as f:
            flags = json.load(f)["trainer_flags"]
    except FileNotFoundError:
        raise ArgumentError(f"--omnibal-plan {path}: no such file") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ArgumentError(f"--omnibal-plan {path}: not a plan from `omnibal plan` ({e})") from None
    return trainer_argv(flags)


def import_family_modules(argv: list[str]) -> None:
    """Import the ``--family-module`` modules of ``argv`` (before the parser is built: their presets are
    ``--model`` choices). Each registers its family (``omnibal_ext.model.families.register``)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--family-module", action="append", default=[])
    modules = pre.parse_known_args(argv)[0].family_module
    if modules:
        import_modules(modules)


def requested_device(argv=None) -> str:
    """The --device of ``argv`` (default: sys.argv[1:]) before the full parse and checks: the CPU
    patches (cpu_compat) must be in place before any process group starts."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    import_family_modules(argv)
    args, _ = build_parser().parse_known_args(argv)
    return args.device


def parse_args(argv=None, world_size: int = 1):
    """Parse and check the flags (for ``world_size`` processes); the result is never written to: what follows
    from the flags is megatron.training.run_plan's RunPlan.  With --omnibal-plan, the plan's flags come first,
    so flags given on the command line override them."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    import_family_modules(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.omnibal_plan:
        args = parser.parse_args(plan_flags(args.omnibal_plan) + argv)
    validate_args(args, world_size)
    return args
