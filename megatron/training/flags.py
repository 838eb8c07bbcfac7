"""The trainer's flags: Megatron's for what exists here, plus ``--omnibal-*`` (the parser only).

What the flags describe is built in ``specs.py`` and checked in ``validation.py``; ``arguments.parse_config``
runs the three in order and returns the typed ``config.RunConfig``.
"""
from __future__ import annotations

import argparse

from omnibal_ext.errors import UserError
from omnibal_ext.model.cost_model import DEVICES
from omnibal_ext.model.sample_time import ISF_TIME_DEVICE
from omnibal_ext.model.trainable import add_freeze_flags
from omnibal_ext.model.units import PRESETS, default_model

import megatron.vlm.families  # noqa: F401  importing it registers the built-in families (--model's choices)

DEFAULT_ISF_BUFFER = 256  # online ISF: look-ahead samples per data-parallel rank (--omnibal-isf-buffer)


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
                   help="meta JSON, or one annotation JSONL (conversations or messages records), or an Energon dataset "
                        "(a folder with .nv-meta/ in Megatron-Bridge's layout or `omnibal data to-energon`'s, or a "
                        "MetadatasetV2 YAML; its 'train' split, read with Energon's savable loader per data-parallel "
                        "rank, nothing scanned); default: the built-in digits dataset, made on first run")
    g.add_argument("--valid-data-path", default=None,
                   help="meta JSON or annotation JSONL for evaluation, or an Energon dataset (its 'val' split) with an "
                        "Energon --data-path (default: the built-in dataset's held-out split)")
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
    g.add_argument("--log-sample-ids", action="store_true",
                   help="with --json-log: each iteration's sample ids, per data-parallel rank and micro-batch, in the "
                        "JSON lines (dataset indices; an Energon sample's id is a hash of its shard and key)")
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
    g.add_argument("--omnibal-isf-buffer", type=int, default=None, metavar="N",
                   help="online ISF (an Energon --data-path): look-ahead samples per data-parallel rank the groups "
                        f"are chosen from (default {DEFAULT_ISF_BUFFER})")
    g.add_argument("--omnibal-isf-stats", default=None, metavar="FILE",
                   help="online ISF (an Energon --data-path): per-sample stats of the data (`omnibal isf stats --write` "
                        "with this model) whose offline ISF search gives the caps and time targets (instead of "
                        "--omnibal-isf-qv/-qt/-vit-time/-llm-time or what the ranks have seen)")
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


def dest_of(flag: str) -> str:
    """The parsed namespace's attribute of ``flag`` (``--moe-router-topk`` -> ``moe_router_topk``)."""
    return flag[2:].replace("-", "_")


def given_flags(flags: argparse.Namespace, names) -> list[str]:
    """Those of the flags ``names`` (``--x-y``) whose parsed value differs from the parser's default."""
    defaults = build_parser()
    return [f for f in names if getattr(flags, dest_of(f)) != defaults.get_default(dest_of(f))]
