"""Every family flag is honoured or refused: the flags a family's ``Capabilities`` do not declare are refused when
the flags are parsed, naming the family and the flag (ArgumentError), and the declaring family accepts them.

The bare family is InternVL's planning side with no capabilities declared, registered through the public
``register``; every capability field is walked, so a new field without a flag check fails here."""
from __future__ import annotations

import dataclasses

import pytest

from megatron.training.arguments import parse_flags
from megatron.training.flags import ArgumentError
from megatron.training.validation import CAPABILITY_FLAGS, IMAGE_FLAGS, UNFLAGGED_CAPABILITIES
from omnibal_ext.model import families as planning
from omnibal_ext.model.families import Capabilities
from omnibal_ext.model.units import get_preset

BARE = "bare-test-family"

# capability field -> (flags asking for it, world size they parse at)
ASKING = {
    "drop_path": (["--vision-drop-path-rate", "0.3"], 1),
    "context_parallel": (["--context-parallel-size", "2"], 2),
    "sequence_parallel": (["--sequence-parallel", "--tensor-model-parallel-size", "2"], 2),
    "lora_targets": (["--lora-rank", "4", "--lora-targets", "vit.qkv"], 1),
    "moe": (["--num-experts", "4", "--moe-ffn-hidden-size", "32"], 1),
    "video": (["--video-max-frames", "4"], 1),
}
IMAGE_VALUES = {"--max-num-tiles": "3", "--min-num-tiles": "2", "--min-pixels": "3136", "--max-pixels": "12544"}


@pytest.fixture
def bare():
    internvl = planning.FAMILIES[get_preset("tiny").family]
    spec = get_preset("tiny").replace(name="bare-tiny", family=BARE)
    planning.register(dataclasses.replace(internvl, name=BARE, capabilities=Capabilities(),
                                          presets={"bare-tiny": spec}))
    try:
        yield "bare-tiny"
    finally:
        planning.unregister(BARE)


def test_every_capability_field_has_a_check():
    fields = {f.name for f in dataclasses.fields(Capabilities)}
    assert fields == set(CAPABILITY_FLAGS) | set(UNFLAGGED_CAPABILITIES) | {"lora_targets", "image_flags"}
    assert set(ASKING) == set(CAPABILITY_FLAGS) | {"lora_targets"}


@pytest.mark.parametrize("field", sorted(ASKING))
def test_undeclared_capability_is_refused_naming_family_and_flag(bare, field):
    argv, world = ASKING[field]
    flag = CAPABILITY_FLAGS[field][0] if field in CAPABILITY_FLAGS else "--lora-targets"
    flag = "--video-max-frames" if field == "video" else flag
    with pytest.raises(ArgumentError) as e:
        parse_flags(["--model", bare] + argv, world_size=world)
    assert flag in str(e.value) and BARE in str(e.value)


@pytest.mark.parametrize("flag", IMAGE_FLAGS)
def test_image_flags_are_read_or_refused(flag):
    """Each family's image rule reads its own image flags; the others' are refused, naming family and flag."""
    for model in ("tiny", "qwen2.5-vl-tiny"):
        family = planning.FAMILIES[get_preset(model).family]
        argv = ["--model", model, flag, IMAGE_VALUES[flag]]
        if flag in family.capabilities.image_flags:
            parse_flags(argv)
        else:
            with pytest.raises(ArgumentError, match=f"{flag}: model family {family.name}"):
                parse_flags(argv)


@pytest.mark.parametrize("field", sorted(ASKING))
def test_declared_capability_is_accepted(field):
    """The built-in families that declare a capability parse its flags."""
    argv, world = ASKING[field]
    declaring = [f for f in planning.FAMILIES.values() if getattr(f.capabilities, field)]
    assert declaring
    for family in declaring:
        tiny = next(name for name, spec in family.presets.items() if spec.vision.num_layers <= 4)
        parse_flags(["--model", tiny] + argv, world_size=world)


def test_vit_setting_the_family_lacks_is_refused():
    with pytest.raises(ArgumentError, match="--vision-qk-norm: model family qwen2_5_vl's ViT"):
        parse_flags(["--model", "qwen2.5-vl-tiny", "--vision-qk-norm"])


def test_video_flags_a_family_does_not_implement_are_refused_at_parse_time(bare):
    """A family declaring video refuses the video flags its processor does not implement, naming the flag; a
    family not declaring video refuses every video flag."""
    with pytest.raises(ArgumentError, match="--video-fps is not implemented for internvl"):
        parse_flags(["--model", "tiny", "--video-fps", "1"])
    with pytest.raises(ArgumentError, match="--video-total-pixels is not implemented for internvl"):
        parse_flags(["--model", "tiny", "--video-total-pixels", "100000"])
    with pytest.raises(ArgumentError, match="min_frames 9 > max_frames 8"):
        parse_flags(["--model", "tiny", "--video-min-frames", "9", "--video-max-frames", "8"])
    parse_flags(["--model", "tiny", "--video-min-frames", "2", "--video-max-frames", "4", "--video-folder-fps", "10"])
    with pytest.raises(ArgumentError, match=f"--video-folder-fps: model family {BARE} does not implement it"):
        parse_flags(["--model", bare, "--video-folder-fps", "10"])
    with pytest.raises(ArgumentError, match="--video-total-pixels is not implemented for qwen2_vl"):
        parse_flags(["--model", "qwen2.5-vl-tiny", "--video-total-pixels", "100000"])
    with pytest.raises(ArgumentError, match="--video-max-pixels is not implemented for qwen3_vl"):
        parse_flags(["--model", "qwen3-vl-tiny", "--video-max-pixels", "100000"])
    with pytest.raises(ArgumentError, match="--video-max-pixels is not implemented for qwen3_vl"):  # its processor
        parse_flags(["--model", "qwen3.5-0.8b", "--video-max-pixels", "100000"])
