"""The one registry of model families (``omnibal_ext.model.families``): registering the same object again does
nothing (a plugin imported twice, a worker pool running the trainer's ``main`` with ``--family-module`` more than
once); a different object under a taken name, or a preset name another family has, is refused and leaves the
registry as it was; the built-in families and the trainer's registry are that one; a family's run-time side is
reached through ``Family.runtime`` only. A family's hooks are methods, its kinds of unit ``UnitKind``s whose named
run-time components and HF mappings resolve, and are checked, on first use."""
from __future__ import annotations

import dataclasses

import pytest

from omnibal_ext.errors import UserError
from omnibal_ext.model import families
from omnibal_ext.model.spec import PROJECTOR
from omnibal_ext.model.units import build_units, get_preset, unit_components

NAME = "registry-test-family"


@pytest.fixture
def copy():
    """InternVL's Family under another name, with its own preset; unregistered after the test."""
    internvl = families.family_of(get_preset("tiny"))
    family = dataclasses.replace(internvl, name=NAME, default_preset=None,
                                 presets={"registry-tiny": get_preset("tiny").replace(name="registry-tiny",
                                                                                      family=NAME)})
    yield family
    families.unregister(NAME)


def test_the_same_object_twice_is_a_no_op(copy):
    assert families.register(copy) is copy
    before = dict(families.FAMILIES)
    assert families.register(copy) is copy
    assert families.FAMILIES == before and families.PRESETS["registry-tiny"].family == NAME


def test_a_different_object_under_a_taken_name_is_refused(copy):
    families.register(copy)
    other = dataclasses.replace(copy, capabilities=families.Capabilities())  # equal name, another object
    with pytest.raises(UserError, match=f"model family {NAME!r} is registered already"):
        families.register(other)
    assert families.FAMILIES[NAME] is copy
    twin = dataclasses.replace(copy)  # even an equal copy is another object
    assert twin == copy and twin is not copy
    with pytest.raises(UserError, match="registered already"):
        families.register(twin)


def test_a_taken_preset_name_is_refused(copy):
    stealing = dataclasses.replace(copy, presets={"tiny": get_preset("tiny").replace(family=NAME)})
    with pytest.raises(UserError, match="preset\\(s\\) tiny belong to family 'internvl'"):
        families.register(stealing)
    assert NAME not in families.FAMILIES and families.PRESETS["tiny"].family == "internvl"


def test_register_takes_only_families():
    with pytest.raises(TypeError, match="is no omnibal_ext.model.families.Family"):
        families.register(object())


def test_one_registry_for_planners_and_trainer():
    from megatron.vlm import families as package

    assert package.FAMILIES is families.FAMILIES and package.register is families.register
    assert {"internvl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"} <= set(families.FAMILIES)


def test_the_runtime_is_reached_through_the_family(copy):
    from megatron.vlm.stage.components import FamilyRuntime
    from megatron.vlm.stage.components import runtime_family

    families.register(copy)
    spec = families.PRESETS["registry-tiny"]
    runtime = runtime_family(spec)
    assert isinstance(runtime, FamilyRuntime) and runtime is runtime_family(get_preset("tiny"))
    planner_only = dataclasses.replace(copy, runtime="")
    families.unregister(NAME)
    families.register(planner_only)
    with pytest.raises(UserError, match="has no run-time side"):
        runtime_family(spec)


def test_every_kind_of_every_family_resolves():
    """Each kind's named parts import as what they must be: its runtime a RuntimeComponent class (its ``reads``
    micro-batch parts), its HF mapping a function where the family has an HF side; the kinds' costs bind."""
    from megatron.vlm.hf.keys import hf_mapping_of
    from megatron.vlm.stage.components import RuntimeComponent, runtime_family, runtime_of

    for family in families.FAMILIES.values():
        spec = next(iter(family.presets.values()))
        has_hf = runtime_family(spec).hf is not None
        for kind in family.kinds:
            assert issubclass(runtime_of(kind), RuntimeComponent), kind.name
            if has_hf:
                assert callable(hf_mapping_of(kind)), kind.name
        for unit, cost in zip(build_units(spec), unit_components(spec)):
            assert (cost.kind, cost.code) == (unit.kind, unit.code) and family.kind(unit.kind).cost is type(cost)


def test_a_kind_whose_parts_do_not_resolve_is_a_bug(copy):
    """A kind's runtime or HF mapping naming nothing, or the wrong thing, is a TypeError naming the kind when first
    used; a kind without them plans but does not run (UserError); a unit list placing a kind the family does not
    declare is a TypeError."""
    from megatron.vlm.hf.keys import hf_mapping_of
    from megatron.vlm.stage.components import runtime_family, runtime_of

    projector = next(k for k in copy.kinds if k.role == PROJECTOR)
    missing = dataclasses.replace(projector, runtime="megatron.vlm.stage.components:NoSuchComponent")
    with pytest.raises(TypeError, match="unit kind 'projector': its runtime .*NoSuchComponent' does not import"):
        runtime_of(missing)
    not_a_component = dataclasses.replace(projector, runtime="megatron.vlm.stage.components:StageContext")
    with pytest.raises(TypeError, match="unit kind 'projector': its runtime .* is no RuntimeComponent class"):
        runtime_of(not_a_component)
    bad_reads = dataclasses.replace(projector, reads={"pixles"})
    with pytest.raises(TypeError, match="unit kind 'projector': reads \\['pixles'\\]"):
        runtime_of(bad_reads)
    with pytest.raises(TypeError, match="unit kind 'projector': its Hugging Face mapping .* is not callable"):
        hf_mapping_of(dataclasses.replace(projector, hf="megatron.vlm.hf.recipes:__doc__"))
    with pytest.raises(UserError, match="unit kind 'projector' has no run-time side"):
        runtime_of(dataclasses.replace(projector, runtime=""))
    with pytest.raises(UserError, match="unit kind 'projector' has no Hugging Face mapping"):
        hf_mapping_of(dataclasses.replace(projector, hf=""))

    broken = dataclasses.replace(copy, kinds=tuple(missing if k is projector else k for k in copy.kinds))
    families.register(broken)
    with pytest.raises(TypeError, match="NoSuchComponent"):  # checked when the run-time side is first loaded
        runtime_family(families.PRESETS["registry-tiny"])
    families.unregister(NAME)
    families.register(dataclasses.replace(copy, kinds=tuple(k for k in copy.kinds if k is not projector)))
    with pytest.raises(TypeError, match="unit 'projector' is of kind 'projector', which is not one of the family's"):
        build_units(families.PRESETS["registry-tiny"])


def test_a_kind_is_checked_when_declared(copy):
    projector = next(k for k in copy.kinds if k.role == PROJECTOR)
    with pytest.raises(TypeError, match="role 'X' is no layout letter"):
        dataclasses.replace(projector, role="X")
    with pytest.raises(TypeError, match="cost <class 'int'> is no CostComponent class"):
        dataclasses.replace(projector, cost=int)
    with pytest.raises(TypeError, match="runtime 'megatron.vlm.stage.components.Head' is not 'module:attribute'"):
        dataclasses.replace(projector, runtime="megatron.vlm.stage.components.Head")
    with pytest.raises(TypeError, match="kinds must be UnitKinds of distinct names"):
        dataclasses.replace(copy, kinds=copy.kinds + (projector,))


def test_a_family_says_what_its_vit_counts(copy):
    """``vision_item`` is "tile" or "patch"; a family counting patches needs its ViT spec's ``segments_sq``
    (``PatchVision``): InternViT's counts tiles and has none."""
    with pytest.raises(TypeError, match="vision_item must be one of \\('tile', 'patch'\\), got 'frame'"):
        dataclasses.replace(copy, vision_item="frame")
    with pytest.raises(TypeError, match="its vision spec VisionSpec must give segments_sq"):
        dataclasses.replace(copy, vision_item="patch")
    assert not copy.native_resolution and families.family_of(get_preset("qwen2.5-vl-tiny")).native_resolution


def test_a_family_gives_its_unit_list():
    """The hooks are methods: ``unit_list`` has no default (the base class is abstract), the others have."""
    with pytest.raises(TypeError, match="abstract method.* unit_list"):
        families.Family(name="no-units", vision_spec=object, kinds=(), vision_item="tile")
