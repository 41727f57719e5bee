"""A model's signature: what every peer of a run trains, in the manifest (DESIGN section 1).

The signature lists the model's parameters in a canonical order (the creator's
``named_parameters``): each one's name, full shape, dtype and Streaming DiLoCo fragment,
and the digest of the run's initial weights: the state digest (``core/state.py``) of the
round-0 global state, ``theta_g`` laid out flat as :meth:`ModelSignature.layout` says. So:

* a peer whose model has other names, shapes or dtypes is refused before it averages
  anything, with the first differences named (:meth:`ModelSignature.differences`);
* the flat layout every peer averages over follows from the manifest alone (parameters
  by name, not by the order a peer's module happens to list them), so tools such as
  ``swarmloco export`` need no model code;
* a peer whose initial weights differ can fetch the round-0 state from any peer and
  check it against the digest: nobody needs to trust the first donor.

Pure data and checks; :func:`signature_of` reads a module (torch, imported there).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from swarmloco.core.agreement import DIGEST_BYTES
from swarmloco.errors import ManifestError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from swarmloco.core.flat import FlatLayout

LayerUnit = Callable[[str], str]
"""The layer a parameter belongs to, by name (Streaming DiLoCo fragments group layers)."""

_DTYPES = ("float32", "float16", "bfloat16", "float64")
_DIGIT = re.compile(r"[0-9]+")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter of a signature."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    fragment: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe_shape(self) -> str:
        inner = ", ".join(str(d) for d in self.shape)
        return f"({inner},)" if len(self.shape) == 1 else f"({inner})"


@dataclasses.dataclass(frozen=True)
class ModelSignature:
    """The parameters every peer of a run trains, and the digest of their initial values."""

    params: tuple[ParamSpec, ...]
    init_digest: bytes

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ManifestError("a model signature names each parameter once")
        if len(self.init_digest) != DIGEST_BYTES:
            raise ManifestError(f"the initial digest must have {DIGEST_BYTES} bytes")
        fragments = {p.fragment for p in self.params}
        if fragments and fragments != set(range(max(fragments) + 1)):
            raise ManifestError(f"fragments {sorted(fragments)} are not 0..F-1")

    @property
    def fragments(self) -> int:
        return max((p.fragment for p in self.params), default=-1) + 1

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def layout(self, block_size: int) -> FlatLayout:
        """The flat, fragment-ordered layout of ``theta_g`` for codec blocks of this size."""
        from swarmloco.core.flat import FlatLayout

        return FlatLayout(
            [(p.name, p.shape) for p in self.params],
            [p.fragment for p in self.params],
            block_size,
        )

    # -- the manifest ---------------------------------------------------------------------

    def to_manifest(self) -> dict[str, Any]:
        return {
            "params": [[p.name, list(p.shape), p.dtype, p.fragment] for p in self.params],
            "init_digest": self.init_digest.hex(),
        }

    @classmethod
    def from_manifest(cls, value: Mapping[str, Any]) -> ModelSignature:
        """Parse the manifest's ``model.signature``; ManifestError when malformed."""
        try:
            params = tuple(
                ParamSpec(str(name), tuple(int(d) for d in shape), str(dtype), int(fragment))
                for name, shape, dtype, fragment in value["params"]
            )
            digest = bytes.fromhex(value["init_digest"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"the manifest's model signature is malformed: {exc}") from exc
        for p in params:
            if p.dtype not in _DTYPES or any(d < 0 for d in p.shape) or p.fragment < 0:
                raise ManifestError(f"the manifest's model signature has a bad entry: {p}")
        return cls(params, digest)

    # -- comparing --------------------------------------------------------------------------

    def differences(self, theirs: Sequence[ParamSpec], *, limit: int = 5) -> list[str]:
        """How a peer's model (``theirs``: :func:`params_of` it) differs from this, the
        swarm's: the first ``limit`` differences, each naming the parameter (empty when
        names, shapes and dtypes all match; order and fragments do not matter: the layout
        follows the signature, by name)."""
        found: list[str] = []
        by_name = {p.name: p for p in theirs}
        ours = {p.name for p in self.params}
        missing = [p for p in self.params if p.name not in by_name]
        unexpected = [q for q in theirs if q.name not in ours]
        for p in self.params:
            q = by_name.get(p.name)
            if q is None:
                continue
            if q.shape != p.shape:
                found.append(f"{p.name}: expected {p.describe_shape()}, got {q.describe_shape()}")
            elif q.dtype != p.dtype:
                found.append(f"{p.name}: expected {p.dtype}, got {q.dtype}")
        # A parameter that is missing where one of the same shape is unexpected was most
        # likely renamed: say so in one line.
        for p in missing:
            twin = next((q for q in unexpected if q.shape == p.shape), None)
            if twin is not None:
                unexpected.remove(twin)
                found.append(
                    f"{p.name}: not in this model, which has {twin.name} of the same shape "
                    f"{p.describe_shape()} instead (renamed?)"
                )
            else:
                found.append(f"{p.name}: missing from this model ({p.describe_shape()})")
        found += [
            f"{q.name}: not in the swarm's model ({q.describe_shape()} {q.dtype})"
            for q in unexpected
        ]
        return found[:limit]


def default_layer_unit(name: str) -> str:
    """The layer of a parameter by the usual naming: everything up to the first index
    (``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``), else the top module
    (``fc1.weight`` -> ``fc1``)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if _DIGIT.fullmatch(part):
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else name


def params_of(model: nn.Module, fragment_of: Sequence[int] | None = None) -> tuple[ParamSpec, ...]:
    """The parameters of ``model`` as signature entries (fragment 0 unless given)."""
    named = list(model.named_parameters())
    fragments = list(fragment_of) if fragment_of is not None else [0] * len(named)
    return tuple(
        ParamSpec(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), f)
        for (n, p), f in zip(named, fragments, strict=True)
    )


def signature_of(
    model: nn.Module,
    *,
    fragments: int,
    block_size: int,
    layer_unit: LayerUnit = default_layer_unit,
    values: Sequence[torch.Tensor] | None = None,
) -> ModelSignature:
    """The signature of ``model`` as it is now (its current weights are the initial ones).
    ``values``: the parameters' whole values in model order, when the model holds shards."""
    from swarmloco.core.fragments import assign_fragments

    names = [n for n, _ in model.named_parameters()]
    if not names:
        raise ValueError("the model has no parameters to train")
    params = params_of(model, assign_fragments([layer_unit(n) for n in names], fragments))
    for p in params:
        if p.dtype not in _DTYPES:
            raise ValueError(
                f"parameter {p.name} is {p.dtype}; only floating-point parameters can be "
                f"averaged ({', '.join(_DTYPES)})"
            )
    provisional = ModelSignature(params, bytes(DIGEST_BYTES))
    return ModelSignature(params, initial_digest(model, provisional, block_size, values))


def initial_digest(
    model: nn.Module,
    signature: ModelSignature,
    block_size: int,
    values: Sequence[torch.Tensor] | None = None,
) -> bytes:
    """The state digest of ``model``'s current weights (or ``values``, the whole values of
    its parameters in model order) as a round-0 ``theta_g``."""
    from swarmloco.core.state import THETA_G, state_digest

    layout = signature.layout(block_size)
    if values is None:
        ordered = parameters_in_order(model, signature.params)
    else:
        by_name = dict(zip((n for n, _ in model.named_parameters()), values, strict=True))
        ordered = [by_name[p.name] for p in signature.params]
    theta = layout.gather(ordered, layout.zeros())
    return state_digest({THETA_G: theta})


def parameters_in_order(model: nn.Module, params: Sequence[ParamSpec]) -> list[Any]:
    """The module's parameters in the signature's order (matched by name)."""
    named = dict(model.named_parameters())
    return [named[p.name] for p in params]
