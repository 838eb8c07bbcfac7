"""Run by tests/test_gated_delta_net_tp2.py under torchrun (2 ranks, TP 2, gloo): our Gated DeltaNet on the packed
row of gdn_cases at TP 2, without and with sequence parallelism. Rank 0 writes the outputs, input gradients and
weight gradients (in the HF layout, from both ranks' shards), rank 0's saved bytes and the checkpoint's global
tensors to ``argv[1]/tp2.pt``; the test compares with TP 1."""
import sys

import torch


def run(sequence_parallel: bool) -> dict:
    import gdn_cases

    from megatron.core import parallel_state
    from megatron.training.memory import ActivationMeter
    from megatron.vlm.families.qwen3_5.gated_delta_net_hf import OUR_NAMES, ours_to_hf

    rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    layer = gdn_cases.our_layer(gdn_cases.hf_tensors(gdn_cases.hf_layer(seed=2)), tp=2, rank=rank, chunk_size=5,
                                sequence_parallel=sequence_parallel)
    x, cu, seed_w = gdn_cases.packed_input()
    if sequence_parallel:  # this rank's half of the tokens
        half = x.shape[0] // 2
        x, seed_w = x[rank * half:(rank + 1) * half], seed_w[rank * half:(rank + 1) * half]
    x = x.clone().requires_grad_()
    meter = ActivationMeter(layer)
    with meter.measure():
        out, _ = layer(x, packed_seq_params=gdn_cases.thd_params(cu))
    (out * seed_w).sum().backward()
    shards = [None, None]
    torch.distributed.all_gather_object(shards, {n: p.grad for n, p in layer.named_parameters()}, group=group)
    grads = ours_to_hf([{n: s[n] for n in OUR_NAMES} for s in shards], layer.dims)
    norm_grads = [s["out_norm.weight"] for s in shards]
    if sequence_parallel:
        parts = [None, None]
        torch.distributed.all_gather_object(parts, (out.detach(), x.grad), group=group)
        out, x_grad = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
        out, x_grad = out.detach(), x.grad
    pieces = [None, None]
    torch.distributed.all_gather_object(pieces, gdn_cases.checkpoint_pieces(layer), group=group)
    return {"checkpoint": gdn_cases.assemble(pieces[0] + pieces[1]), "out": out, "x_grad": x_grad, "grads": grads,
            "norm_grads": norm_grads,
            "saved_bytes": meter.per_microbatch[0]}


def main(argv: list[str]) -> int:
    """``argv``: the folder rank 0 writes ``tp2.pt`` to."""
    from megatron.training import cpu_compat
    from megatron.training.initialize import destroy, initialize_distributed, set_seeds

    folder = argv[0]
    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 2, 1)
        set_seeds(0)
        result = {sp: run(sp) for sp in (False, True)}
        if torch.distributed.get_rank() == 0:
            torch.save(result, f"{folder}/tp2.pt")
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
