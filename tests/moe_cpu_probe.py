"""One megatron-core MoELayer (SequentialMLP experts, top-2 softmax router) per rank, at expert-parallel size =
the world, under ``cpu_compat.patched()``: its output and gradients against a plain-torch MoE computed from all
ranks' weights (tests/test_cpu_compat.py launches it).  argv: dispatcher (alltoall | allgather)."""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.training import cpu_compat

E, K, H, I, S = 4, 2, 16, 24, 7  # experts, top-k, hidden, expert FFN, tokens per rank


def reference(x, router_w, fc1, fc2):
    """Top-K softmax routing (probabilities renormalised over the K chosen), SwiGLU experts, weighted sum."""
    probs = torch.softmax(x @ router_w.t(), dim=-1)
    top, idx = probs.topk(K, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(E):
        gate, up = (x @ fc1[e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ fc2[e].t()
        w = (top * (idx == e)).sum(-1, keepdim=True)
        out = out + w * y
    return out


def main(argv: list[str]) -> int:
    """``argv``: the token dispatcher (alltoall, allgather)."""
    from megatron.training.initialize import destroy, initialize_distributed

    dispatcher = argv[0]
    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 1, 1, ep=int(os.environ["WORLD_SIZE"]))
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        ep, rank = dist.get_world_size(), dist.get_rank()
        assert parallel_state.get_expert_model_parallel_world_size() == ep
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(
            num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=K,
            moe_ffn_hidden_size=I, ffn_hidden_size=I, moe_token_dispatcher_type=dispatcher, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
            moe_router_load_balancing_type="none", moe_router_pre_softmax=False, expert_model_parallel_size=ep,
            bias_activation_fusion=False, gradient_accumulation_fusion=False, moe_permute_fusion=False)
        spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp
        layer = build_module(spec, config=config)
        with torch.no_grad():  # distinct weights everywhere (megatron-core draws the local experts per rank)
            for p in layer.parameters():
                p.normal_(0, 0.3)
            layer.router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(1)))
        torch.manual_seed(100 + rank)
        x = torch.randn(S, 1, H, requires_grad=True)
        out, _ = layer(x)
        out.square().sum().backward()
        local = [(m.linear_fc1.weight.detach(), m.linear_fc2.weight.detach()) for m in layer.experts.local_experts]
        everyone = [None] * ep
        dist.all_gather_object(everyone, (x.detach(), local))
        fc1 = torch.stack([w1 for _, loc in everyone for w1, _ in loc])
        fc2 = torch.stack([w2 for _, loc in everyone for _, w2 in loc])
        rw = layer.router.weight.detach()
        xs = [xr for xr, _ in everyone]
        # the reference: every rank's tokens through the whole MoE; loss summed over the world, as the layer's is
        ref_fc1, ref_fc2 = fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
        ref_x = [xr.clone().requires_grad_() for xr in xs]
        ref_out = [reference(xr.squeeze(1), rw, ref_fc1, ref_fc2) for xr in ref_x]
        sum(o.square().sum() for o in ref_out).backward()
        first = rank * (E // ep)

        def rel(ours, ref):
            """Largest difference over the reference's largest magnitude."""
            return float((ours - ref).abs().max() / ref.abs().max())

        mine = layer.experts.local_experts
        report = {
            "out": rel(out.squeeze(1), ref_out[rank]),
            "x_grad": rel(x.grad.squeeze(1), ref_x[rank].grad.squeeze(1)),
            "fc1_grad": max(rel(m.linear_fc1.weight.grad, ref_fc1.grad[first + j]) for j, m in enumerate(mine)),
            "fc2_grad": max(rel(m.linear_fc2.weight.grad, ref_fc2.grad[first + j]) for j, m in enumerate(mine)),
        }
        print("MOE_REPORT " + json.dumps(report), flush=True)
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
