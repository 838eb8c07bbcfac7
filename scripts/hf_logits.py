"""Logits of our model on a Hugging Face folder (InternVL, Qwen2.5-VL, Qwen3-VL), at any TP/PP/layout (the check against transformers).

    torchrun --nproc-per-node N scripts/hf_logits.py --hf-checkpoint DIR --inputs IN.pt --out OUT.pt \\
        [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P] [--pipeline-layout L] \\
        [--expert-model-parallel-size E] [--expert-tensor-parallel-size ET]

IN.pt: transformers' own inputs for the model's family (``HFSide.logits_batch`` makes the micro-batch):
InternVL ``{"input_ids": LongTensor [1, s], "pixel_values": FloatTensor [tiles, 3, H, W]}``, the input_ids already
holding image_seq_length image-token ids per tile; Qwen2.5-VL ``{"input_ids" [1, s], "pixel_values" [patches,
3*2*14*14], "image_grid_thw" [n, 3], "mm_token_type_ids" [1, s]}`` as its processor returns them, with videos
``"pixel_values_videos" [patches, 3*2*14*14], "video_grid_thw" [v, 3], "second_per_grid_ts" [v]`` and
mm_token_type_ids 2 on their ``<|video_pad|>`` tokens (Qwen3-VL: the same, patches of 3*2*16*16, no
second_per_grid_ts: its timestamps are text; DeepStack features live at a stage boundary travel packed with the
hidden states). An input the family does not implement (any other key, a padded attention_mask, Qwen3.5 or
InternVL video keys) is refused, never ignored. OUT.pt: float32
logits ``[s, real vocabulary]`` of our model (fp32 on CPU), written by the last stage's TP rank 0. Each rank reads
only its own units and TP slices of the safetensors (an MoE layer: its EP rank's experts, their ETP slices). MoE
layers under TP > 1 run sequence parallel (megatron-core's MoELayer needs it): the input is then padded at its end to
a multiple of TP with text tokens, and their logits dropped (causal attention: no real token sees them). The flags go
through the trainer's own parse-time checks first (``megatron.training.arguments.parse_flags``: TP against the heads
and key/value groups, the expert grid, the layout), so a size the trainer refuses is refused here before any weight
is read, naming the flag. Compare with
``<Model>ForConditionalGeneration.from_pretrained(DIR)(**inputs).logits[0]`` (Qwen2.5-VL: pass mm_token_type_ids,
or transformers uses 1-D positions).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", required=True)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-layout", default=None)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: TP")
    p.add_argument("--image-token-id", type=int, default=None, help="default: the config's image_token_id")
    args = p.parse_args(argv)

    import torch.distributed as dist

    from megatron.training import cpu_compat
    from megatron.training.arguments import parse_flags
    from megatron.training.initialize import destroy, initialize_distributed, set_seeds
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import pipeline_logits
    from omnibal_ext.errors import UserError, report
    from omnibal_ext.model.layout import default_layout, parse_layout

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size  # ETP None: TP
    try:
        with cpu_compat.patched():
            src = HFSource.open(args.hf_checkpoint)  # the checks first: no process group yet to tear down
            parse_flags(trainer_argv(args, sequence_parallel=src.spec.language.moe is not None and tp > 1),
                        world_size=int(os.environ.get("WORLD_SIZE", "1")))
            layout = parse_layout(args.pipeline_layout, src.spec, pp) if args.pipeline_layout else \
                default_layout(src.spec, pp)
            try:
                initialize_distributed(torch.device("cpu"), tp, pp, ep=ep, etp=etp)
                set_seeds(0)  # megatron-core's model-parallel RNG (its blocks fork it under sequence parallelism)
                inputs = torch.load(args.inputs, weights_only=True)
                logits = pipeline_logits(src, inputs, layout, args.image_token_id)
                from megatron.core import parallel_state as ps

                if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                    torch.save(logits, args.out)
                    print(f"> logits {tuple(logits.shape)} written to {args.out}", flush=True)
                dist.barrier()
            finally:
                destroy()
    except UserError as e:
        return report(e, "hf_logits: ")
    return 0


def trainer_argv(args, sequence_parallel: bool) -> list[str]:
    """The trainer's flags for this model and layout (what ``parse_flags`` checks), from this script's ``args``."""
    argv = ["--hf-checkpoint", args.hf_checkpoint,
            "--tensor-model-parallel-size", str(args.tensor_model_parallel_size),
            "--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size),
            "--expert-model-parallel-size", str(args.expert_model_parallel_size)]
    if args.pipeline_layout:
        argv += ["--pipeline-layout", args.pipeline_layout]
    if args.expert_tensor_parallel_size is not None:
        argv += ["--expert-tensor-parallel-size", str(args.expert_tensor_parallel_size)]
    if sequence_parallel:  # MoE layers at TP > 1 run sequence parallel, as the trainer's --sequence-parallel
        argv += ["--sequence-parallel"]
    return argv


if __name__ == "__main__":
    sys.exit(main())
