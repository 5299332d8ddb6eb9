"""The lossy host tier: blocks quantized (int8, fp8) in CPU memory, under the host tier's name.

Only blocks of lossy namespaces reach it (docs/design.md, "Lossy tiers"); ``[cache] quantize =
{ host = "int8" }`` is its old spelling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from gateway.core.quantization import QUANTIZATIONS
from gateway.core.sizes import GiB
from tiers.kinds.base import TierContext, bytes_problem
from tiers.kinds.host import HOST

if TYPE_CHECKING:
    from tiers.base import BlockStore


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantizedHostTierConfig:
    """``[[cache.tier]] kind = "quantized_host"``.

    Attributes:
        bytes: the tier's budget of CPU memory (quantized payloads: about 0.27x float32's).
        quantize: the lossy format kept ("int8", "fp8").
    """

    kind: ClassVar[str] = "quantized_host"
    size_keys: ClassVar[tuple[str, ...]] = ("bytes",)
    path_keys: ClassVar[tuple[str, ...]] = ()

    bytes: int = 4 * GiB
    quantize: str = "int8"

    @property
    def budget_bytes(self) -> int:
        return self.bytes

    @property
    def lossy_format(self) -> str:
        return self.quantize

    @property
    def write_through(self) -> bool:
        return False

    def problems(self) -> list[str]:
        errors = [p for p in (bytes_problem(self.bytes),) if p]
        if self.quantize not in QUANTIZATIONS:
            errors.append(f"quantize must be one of {', '.join(map(repr, QUANTIZATIONS))}, "
                          f"got {self.quantize!r}")
        return errors


class QuantizedHostTier:
    """The lossy host tier's kind (``tiers.quantized_host.QuantizedHostStore``)."""

    kind = QuantizedHostTierConfig.kind
    tier_name = HOST
    config_type = QuantizedHostTierConfig
    is_remote = False
    may_be_lossy = True
    queues_writes = False
    is_measured = False
    parallel_reads = 1

    def open(self, config: QuantizedHostTierConfig, context: TierContext) -> BlockStore:
        # NOTE: imported here, so that reading a configuration imports no store.
        from gateway.core.quantization import parse_quantization
        from tiers.quantized_host import QuantizedHostStore

        quantization = parse_quantization(config.quantize)
        assert quantization is not None  # problems() refuses "none"
        return QuantizedHostStore(
            layout=context.layout, block_tokens=context.block_tokens, budget_bytes=config.bytes,
            quantization=quantization, pin=context.device.type == "cuda",
            serve_device=context.device, name=self.tier_name)
