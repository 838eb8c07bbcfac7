"""A parameter unfrozen on resume starts with a truly fresh Adam state (moments 0 and its own step 0, so its first
updates are bias-corrected as a fresh Adam's), and keeps its own step through the next checkpoint.

Against an independent computation: one fresh ``torch.optim.AdamW`` per trained parameter, fed the same gradients
from the parameter's first trained iteration on (created at the resume for the newly unfrozen ones)."""
import pytest
import torch

import trainer_parts
from trainer_parts import NoData

pytestmark = pytest.mark.usefixtures("megatron_world")

BASE = ["--lr-warmup-iters", "0", "--clip-grad", "0", "--lr", "1e-2", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--train-iters", "10"]


def _build(argv):
    return trainer_parts.build(BASE + argv)


def _named(model):
    return dict(model[0].module.named_parameters())


def _group_of(optimizer, p):
    """The megatron optimizer's param group (its lr and weight decay) of model parameter ``p``."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        index = getattr(opt, "model_param_group_index_map", None)
        if index is not None:
            if p in index:
                return opt.optimizer.param_groups[index[p][0]]
            continue
        for g in opt.optimizer.param_groups:
            if any(q is p for q in g["params"]):
                return g
    raise KeyError("parameter not in the optimizer")


def _step(model, optimizer, scheduler, refs, iteration):
    """One optimizer step of the megatron optimizer and of every reference AdamW on the same gradients (a
    reference is created, fresh, for a trained parameter that has none yet)."""
    gen = torch.Generator().manual_seed(100 + iteration)
    for name, p in _named(model).items():
        if not p.requires_grad:
            continue
        g = torch.randn(p.shape, generator=gen) * 1e-2
        p.main_grad.copy_(g)
        group = _group_of(optimizer, p)
        if name not in refs:
            q = p.detach().clone().requires_grad_(True)
            refs[name] = (q, torch.optim.AdamW([q], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                               weight_decay=group["weight_decay"]))
        q, ref = refs[name]
        ref.param_groups[0]["lr"], ref.param_groups[0]["weight_decay"] = group["lr"], group["weight_decay"]
        q.grad = g.clone()
        ref.step()
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(increment=16)


def _check(model, refs, what):
    trained = {n: p for n, p in _named(model).items() if p.requires_grad}
    assert set(trained) == set(refs)
    for name, p in trained.items():
        torch.testing.assert_close(p.detach(), refs[name][0].detach(), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{what}: {name}: {m}")


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer"]], ids=["fp32", "distributed"])
def test_unfrozen_on_resume_steps_like_a_fresh_adamw(tmp_path, extra, capsys):
    from megatron.training.checkpointing import find_checkpoint, load_checkpoint, save_checkpoint

    refs = {}
    plan, model, optimizer, scheduler = _build(extra + ["--freeze-vit", "--save", str(tmp_path / "a")])
    for it in range(1, 4):
        _step(model, optimizer, scheduler, refs, it)
    _check(model, refs, "before the resume")
    vit = {n for n, p in _named(model).items() if p.vlm_role in "Iv"}  # the ViT's (I: its patch embedding)
    assert vit and not vit & set(refs)
    save_checkpoint(plan, 3, 48, model, optimizer, scheduler, NoData())

    # resumed with the ViT trained: its parameters' AdamW starts fresh here, the others' continue at step 4
    plan, model, optimizer, scheduler = _build(extra + ["--load", str(tmp_path / "a"),
                                                              "--save", str(tmp_path / "b")])
    load_checkpoint(find_checkpoint(str(tmp_path / "a")), plan, model, optimizer, scheduler)
    _step(model, optimizer, scheduler, refs, 4)
    assert vit <= set(refs)
    _check(model, refs, "first step after the resume")
    assert "fresh optimizer state (Adam moments 0, step 0)" in capsys.readouterr().out
    save_checkpoint(plan, 4, 64, model, optimizer, scheduler, NoData())  # steps differ per parameter now

    # resumed again under the same flags: every parameter keeps its own step (ViT 1, the others 4)
    plan, model, optimizer, scheduler = _build(extra + ["--load", str(tmp_path / "b")])
    load_checkpoint(find_checkpoint(str(tmp_path / "b")), plan, model, optimizer, scheduler)
    _step(model, optimizer, scheduler, refs, 5)
    _check(model, refs, "after a second resume")


def _main_params(model, optimizer):
    """{parameter name: its fp32 main copy (flattened)} of the bf16 optimizers (one rank: whole tensors)."""
    from megatron.training.checkpointing.param_steps import _model_and_state_params

    name_of = {id(p): n for n, p in _named(model).items()}
    return {name_of[id(p)]: main.detach().reshape(-1).clone()
            for opt in optimizer.chained_optimizers for p, main in _model_and_state_params(opt)}


def _steps_by_role(model, optimizer):
    """{role: the set of Adam step counts of that role's trained parameters} (per parameter, from its state)."""
    from megatron.training.checkpointing.param_steps import _adam_states
    from megatron.training.checkpointing.state import model_sharded_state_dict

    role_of = {sh.key: sh.data.vlm_role for sh in model_sharded_state_dict(model).values()
               if hasattr(getattr(sh, "data", None), "vlm_role")}
    out = {}
    for key, states in _adam_states(model, optimizer).items():
        out.setdefault(role_of[key], set()).update(float(s["step"]) for s in states)
    return out


@pytest.mark.parametrize("extra", [["--bf16"], ["--bf16", "--use-distributed-optimizer"]], ids=["mixed", "distributed"])
def test_bf16_optimizers_keep_per_parameter_steps(tmp_path, extra):
    """The bf16 optimizers (fp32 main copies; their sharded form): every trained tensor's step is found, the
    unfrozen ViT's start at 0 while the others keep the run's, and a save with steps that differ (which
    megatron-core refuses on its own) keeps them."""
    from megatron.training.checkpointing import find_checkpoint, load_checkpoint, save_checkpoint

    def steps(model, optimizer, scheduler, n):
        for _ in range(n):
            for p in _named(model).values():
                if p.requires_grad:
                    p.main_grad.copy_(torch.full(p.shape, 1e-3))
            assert optimizer.step()[0]
            scheduler.step(increment=16)

    plan, model, optimizer, scheduler = _build(extra + ["--freeze-vit", "--save", str(tmp_path / "a")])
    steps(model, optimizer, scheduler, 2)
    trained_roles = {p.vlm_role for p in _named(model).values() if p.requires_grad}
    assert _steps_by_role(model, optimizer) == {r: {2.0} for r in trained_roles}
    save_checkpoint(plan, 2, 32, model, optimizer, scheduler, NoData())
    mains = _main_params(model, optimizer)
    plan, model, optimizer, scheduler = _build(extra + ["--load", str(tmp_path / "a"), "--save", str(tmp_path / "b")])
    load_checkpoint(find_checkpoint(str(tmp_path / "a")), plan, model, optimizer, scheduler)
    # fp32 main copies: the saved ones, and for the unfrozen ViT its loaded bf16 weights
    loaded = _main_params(model, optimizer)
    weights = {n: p.detach().float().reshape(-1) for n, p in _named(model).items()}
    assert set(loaded) - set(mains) and all(_named(model)[n].vlm_role in "Iv" for n in set(loaded) - set(mains))
    for name, main in loaded.items():
        assert torch.equal(main, mains.get(name, weights[name])), name
    steps(model, optimizer, scheduler, 1)
    want = {r: {3.0} for r in trained_roles} | {"I": {1.0}, "v": {1.0}}
    assert _steps_by_role(model, optimizer) == want
    save_checkpoint(plan, 3, 48, model, optimizer, scheduler, NoData())
    assert _steps_by_role(model, optimizer) == want  # put back after the save
    plan, model, optimizer, scheduler = _build(extra + ["--load", str(tmp_path / "b")])
    load_checkpoint(find_checkpoint(str(tmp_path / "b")), plan, model, optimizer, scheduler)
    assert _steps_by_role(model, optimizer) == want
