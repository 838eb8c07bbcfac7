"""The one registry of model families (``omnibal_ext.model.families``): registering the same object again does
nothing (a plugin imported twice, a worker pool running the trainer's ``main`` with ``--family-module`` more than
once); a different object under a taken name, or a preset name another family has, is refused and leaves the
registry as it was; the built-in families and the trainer's registry are that one; a family's run-time side is
reached through ``Family.runtime`` only."""
from __future__ import annotations

import dataclasses

import pytest

from omnibal_ext.errors import UserError
from omnibal_ext.model import families
from omnibal_ext.model.units import get_preset

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
    other = dataclasses.replace(copy, vision_item="patch")  # equal name, another object
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


def test_a_runtime_missing_a_unit_kind_is_a_bug(copy):
    from megatron.vlm.stage.components import FamilyRuntime
    from megatron.vlm.stage.components import runtime_family

    internvl = runtime_family(get_preset("tiny"))
    short = FamilyRuntime(components=internvl.components[1:], vision_config=internvl.vision_config)
    with pytest.raises(TypeError, match=f"family {NAME!r}: no runtime component for unit kind"):
        short.check(copy)
