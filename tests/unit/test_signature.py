"""Model signatures: what the manifest pins down, and how another model is told apart."""

import pytest
import torch
from torch import nn

from swarmloco.core.signature import (
    ModelSignature,
    default_layer_unit,
    initial_digest,
    params_of,
    signature_of,
)
from swarmloco.errors import ManifestError


class Blocks(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 256, names: tuple[str, str] = ("fc", "out")):
        super().__init__()
        self.embed = nn.Embedding(100, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({names[0]: nn.Linear(width, hidden), names[1]: nn.Linear(hidden, width)})
            for _ in range(4)
        )
        self.head = nn.Linear(width, 10)


def sign(model: nn.Module, fragments: int = 1) -> ModelSignature:
    return signature_of(model, fragments=fragments, block_size=64)


def test_the_signature_survives_the_manifest_and_lays_out_theta_by_name():
    torch.manual_seed(0)
    model = Blocks()
    signature = sign(model, fragments=2)
    again = ModelSignature.from_manifest(signature.to_manifest())
    assert again == signature
    assert signature.numel == sum(p.numel() for p in model.parameters())
    # Strided fragments of layer units: embed, blocks.0 .. blocks.3, head.
    fragment = {p.name: p.fragment for p in signature.params}
    assert fragment["embed.weight"] == 0 and fragment["blocks.0.fc.weight"] == 1
    assert fragment["blocks.1.fc.weight"] == 0 and fragment["head.weight"] == 1
    assert signature.layout(64).num_fragments == 2


def test_the_initial_digest_is_of_the_weights_and_nothing_else():
    torch.manual_seed(0)
    a = Blocks()
    torch.manual_seed(0)
    b = Blocks()
    torch.manual_seed(1)
    c = Blocks()
    signature = sign(a)
    assert sign(b).init_digest == signature.init_digest
    assert initial_digest(c, signature, 64) != signature.init_digest


def test_a_wider_layer_is_named_with_both_shapes():
    signature = sign(Blocks(hidden=256))
    differences = signature.differences(params_of(Blocks(hidden=512)))
    assert differences[0] == "blocks.0.fc.weight: expected (256, 64), got (512, 64)"
    assert differences[1] == "blocks.0.fc.bias: expected (256,), got (512,)"
    assert len(differences) == 5  # the first five of many


def test_another_dtype_is_named():
    signature = sign(Blocks())
    half = Blocks().to(torch.bfloat16)
    assert (
        signature.differences(params_of(half))[0] == "embed.weight: expected float32, got bfloat16"
    )


def test_a_renamed_parameter_is_recognised_as_one():
    signature = sign(Blocks(names=("fc", "out")))
    differences = signature.differences(params_of(Blocks(names=("up", "out"))))
    assert differences[0] == (
        "blocks.0.fc.weight: not in this model, which has blocks.0.up.weight of the same "
        "shape (256, 64) instead (renamed?)"
    )


def test_missing_and_extra_parameters_are_named():
    signature = sign(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    fewer = params_of(nn.Sequential(nn.Linear(4, 4)))
    assert signature.differences(fewer) == [
        "1.weight: missing from this model ((2, 4))",
        "1.bias: missing from this model ((2,))",
    ]
    more = params_of(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 3)))
    assert signature.differences(more) == [
        "2.weight: not in the swarm's model ((3, 2) float32)",
        "2.bias: not in the swarm's model ((3,) float32)",
    ]


def test_the_same_model_has_no_differences_whatever_its_order():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    signature = sign(model)
    assert signature.differences(tuple(reversed(params_of(model)))) == []


def test_default_layer_units():
    assert default_layer_unit("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert default_layer_unit("layers.0.weight") == "layers.0"
    assert default_layer_unit("fc1.weight") == "fc1"
    assert default_layer_unit("bias") == "bias"


def test_integer_parameters_and_malformed_signatures_are_refused():
    model = nn.Linear(2, 2)
    model.register_parameter("count", nn.Parameter(torch.zeros(1, dtype=torch.int64), False))
    with pytest.raises(ValueError, match="only floating-point"):
        sign(model)
    with pytest.raises(ManifestError, match="malformed"):
        ModelSignature.from_manifest({"params": [["w", "not a shape"]], "init_digest": "00"})
    with pytest.raises(ManifestError, match="bad entry"):
        ModelSignature.from_manifest({"params": [["w", [2], "int64", 0]], "init_digest": "00" * 32})
