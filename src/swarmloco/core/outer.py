"""The outer optimizer: Nesterov SGD on the fp32 global parameters, on CPU.

Every member of a group applies this step to the same averaged pseudo-gradient and must end
with the same bytes, on any CPU. So each line below is a single IEEE operation on whole
tensors (no fused multiply-add, no ``alpha=`` kernels whose rounding depends on the SIMD
path), in a fixed order. The result equals ``torch.optim.SGD(lr, momentum, nesterov=True)``
up to the rounding of its fused kernels (tested over many steps), and is bit-for-bit
deterministic.

The update, with ``g`` the averaged pseudo-gradient ``theta_g - theta`` (DiLoCo, Alg. 1)::

    b     <- momentum * b + g              (b = g on the first step)
    step  <- g + momentum * b              (Nesterov look-ahead)
    theta_g <- theta_g - lr * step
"""

from __future__ import annotations

import dataclasses
import math

import torch

from swarmloco.core.codec import Encoded, decode_slice_into
from swarmloco.core.config import require, require_fraction, require_positive


def _squares(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer (averaging) optimizer: SGD with Nesterov momentum."""

    lr: float = 0.7
    """Outer learning rate applied to the averaged pseudo-gradient."""
    momentum: float = 0.9
    """Nesterov momentum of the outer step."""
    nesterov: bool = True
    """Use the Nesterov look-ahead (False: heavy-ball momentum)."""

    def __post_init__(self) -> None:
        require_positive("outer lr", self.lr)
        require_fraction("outer momentum", self.momentum, closed_high=False)
        require(isinstance(self.nesterov, bool), "outer nesterov must be true or false")


SLAB_VALUES = 1 << 20
"""Values the outer step works on at once: its scratch is two slabs (8 MB), not a vector's
worth, and a slab stays in the CPU's caches through the step's lines."""


class OuterOptimizer:
    """Nesterov SGD on a flat fp32 CPU vector of global parameters.

    The optimizer owns its momentum buffer; the caller owns ``theta_g``. ``state_dict`` /
    ``load_state_dict`` carry the momentum for checkpoints and state transfer. The step
    runs a slab at a time: every line is elementwise, so the slabs give the bits the whole
    vector would.
    """

    def __init__(
        self, numel: int, config: OuterConfig, *, buffer: torch.Tensor | None = None
    ) -> None:
        """``buffer``: where to keep the momentum (e.g. this fragment's slice of one flat
        vector for the whole model); a new zeroed tensor by default."""
        self.config = config
        if buffer is None:
            buffer = torch.zeros(numel, dtype=torch.float32)
        require(
            buffer.dtype == torch.float32 and buffer.dim() == 1 and buffer.numel() == numel,
            f"the momentum buffer must be a flat float32 tensor of {numel} elements",
        )
        self.momentum_buffer = buffer
        self.steps = 0
        self.last_norm = 0.0
        """The L2 norm of what the last :meth:`step` subtracted from ``theta_g``."""
        self.last_grad_norm = 0.0
        """The L2 norm of the pseudo-gradient of the last :meth:`step`."""

    @torch.no_grad()
    def step(self, theta_g: torch.Tensor, grad: torch.Tensor | Encoded) -> float:
        """Apply one outer step to ``theta_g`` in place, with pseudo-gradient ``grad``
        (fp32, or as the codec encodes it: decoded a slab at a time, one IEEE
        multiplication a value, the same bits on every member). Returns the update's norm.
        """
        self._check(theta_g, "global parameters")
        n = theta_g.numel()
        if isinstance(grad, Encoded):
            require(grad.numel == n, f"pseudo-gradient has {grad.numel} elements, expected {n}")
            slab = max(1, SLAB_VALUES // grad.block_size) * grad.block_size
        else:
            self._check(grad, "pseudo-gradient")
            slab = SLAB_VALUES
        step = torch.empty(min(slab, n), dtype=torch.float32)
        decoded = torch.empty_like(step) if isinstance(grad, Encoded) else None
        update_sq = grad_sq = 0.0
        for start in range(0, n, slab):
            stop = min(start + slab, n)
            if decoded is not None:
                assert isinstance(grad, Encoded)
                g = decoded[: stop - start]
                decode_slice_into(g, grad, start)
            else:
                assert isinstance(grad, torch.Tensor)
                g = grad[start:stop]
            out = step[: stop - start]
            self._step(theta_g[start:stop], self.momentum_buffer[start:stop], g, out)
            update_sq += _squares(out)
            grad_sq += _squares(g)
        self.steps += 1
        self.last_norm, self.last_grad_norm = math.sqrt(update_sq), math.sqrt(grad_sq)
        return self.last_norm

    def _step(
        self, theta_g: torch.Tensor, buf: torch.Tensor, grad: torch.Tensor, step: torch.Tensor
    ) -> None:
        """One slab of the step (``step``: scratch; it ends holding ``lr * step``)."""
        m, lr = self.config.momentum, self.config.lr
        if m == 0.0:
            step.copy_(grad)
        else:
            if self.steps == 0:
                buf.copy_(grad)
            else:
                buf.mul_(m)
                buf.add_(grad)
            if self.config.nesterov:
                torch.mul(buf, m, out=step)
                step.add_(grad)
            else:
                step.copy_(buf)
        step.mul_(lr)
        theta_g.sub_(step)

    def _check(self, t: torch.Tensor, what: str) -> None:
        require(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 1,
            f"{what} must be a flat float32 CPU tensor, got {t.dtype} {t.device} {tuple(t.shape)}",
        )
        require(
            t.numel() == self.momentum_buffer.numel(),
            f"{what} has {t.numel()} elements, the optimizer {self.momentum_buffer.numel()}",
        )

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        return {"momentum_buffer": self.momentum_buffer, "steps": self.steps}

    def load_state_dict(self, state: dict[str, torch.Tensor | int]) -> None:
        buf = state["momentum_buffer"]
        steps = state["steps"]
        require(isinstance(buf, torch.Tensor), "momentum_buffer must be a tensor")
        require(isinstance(steps, int) and steps >= 0, "steps must be a non-negative int")
        assert isinstance(buf, torch.Tensor) and isinstance(steps, int)
        require(
            buf.shape == self.momentum_buffer.shape,
            f"momentum buffer has {buf.numel()} elements, expected {self.momentum_buffer.numel()}",
        )
        self.momentum_buffer.copy_(buf.to(torch.float32))
        self.steps = steps
