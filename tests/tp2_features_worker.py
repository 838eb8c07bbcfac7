"""Run by tests/test_model_features_tp2.py in the worker pool of 2 ranks (``tp2_features_worker:main``; TP 2, gloo): the ViT layer with
qk-norm over padded heads (3 heads -> 4), a Qwen3 LLM layer (per-head q/k norm) and the tiny model's loss with a padded vocabulary, at TP 2.
Rank 0 writes what it computed to ``argv[0]/tp2.pt``; the test compares it with TP 1."""
import sys

import torch


def vit_case():
    """(output, input gradient, q/k-norm weight gradients of the real width) of one ViT layer at TP 2."""
    import tp2_cases

    from megatron.core import parallel_state

    layer, x, w_grad_seed, (qw, kw) = tp2_cases.vit_layer_and_input(tp=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    out = tp2_cases.run_vit(layer, x, w_grad_seed)
    grads = []
    for norm in (layer.self_attention.q_layernorm, layer.self_attention.k_layernorm):
        parts = [torch.empty_like(norm.weight.grad) for _ in range(2)]
        torch.distributed.all_gather(parts, norm.weight.grad.contiguous(),
                                     group=parallel_state.get_tensor_model_parallel_group())
        grads.append(torch.cat(parts)[: tp2_cases.REAL_HEADS * tp2_cases.HEAD_DIM])
    return {"out": out.detach(), "x_grad": x.grad.detach(), "q_grad": grads[0], "k_grad": grads[1], "rank": rank}


def main(argv: list[str]) -> int:
    from megatron.training import cpu_compat
    from megatron.training.initialize import destroy, initialize_distributed, set_seeds

    folder = argv[0]
    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 2, 1)
        set_seeds(0)
        import tp2_cases

        result = vit_case()
        layer, rope, x, seed = tp2_cases.qwen3_layer_and_input(tp=2)
        out = tp2_cases.run_qwen3(layer, rope, x, seed)
        attn = layer.self_attention  # the per-head norms are replicated: every rank holds the whole gradient
        result["qwen3"] = {"out": out.detach(), "x_grad": x.grad.detach(), "q_grad": attn.q_layernorm.weight.grad,
                           "k_grad": attn.k_layernorm.weight.grad}
        batch = torch.load(f"{folder}/batch.pt", weights_only=False)
        model = tp2_cases.tiny_model(tp=2, real_vocab=True).eval()
        with torch.no_grad():
            result["loss"], result["correct"] = model(batch)
        if torch.distributed.get_rank() == 0:
            torch.save(result, f"{folder}/tp2.pt")
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
