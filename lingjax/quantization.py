"""A checkpoint's fp8 layout: config.json's `quantization_config`, read and checked (docs/fp8.md).

The official fp8 checkpoint says `"quant_method": "fp8"`, `"fmt": "e4m3"`, `"weight_block_size": [128, 128]`,
optionally `"scale_fmt": "ue8m0"` (power-of-two scales), and which modules stay unquantized under
`modules_to_not_convert` (transformers' spelling) or `ignored_layers` (vLLM's). Which tensors are fp8 is what
the checkpoint stores: a float8_e4m3fn `X.weight` with its float32 `X.weight_scale_inv`. A listed module is
never fp8; with a list, every other weight of the quantized kinds is (the loader checks both, naming the tensor).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lingjax.config import ConfigError
from lingjax.ops.fp8 import BLOCK, SCALE_FORMATS, device_block
from lingjax.sharding import param_spec

EXCLUSION_KEYS = ("modules_to_not_convert", "ignored_layers")


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int] = BLOCK  # (BN, BK): one scale per BN output rows x BK input columns
    scale_fmt: str = "float32"  # "ue8m0": every scale a power of two
    not_converted: tuple[str, ...] | None = None  # module names left unquantized; None: the config lists none
    activation_scheme: str = "dynamic"  # the checkpoint's; lingjax keeps activations in bf16 (weight-only)

    def __post_init__(self):
        if len(self.block) != 2 or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in self.block):
            raise ConfigError(f"quantization_config.weight_block_size must be two positive integers, got "
                              f"{list(self.block)}")
        if self.scale_fmt not in SCALE_FORMATS:
            raise ConfigError(f"quantization_config.scale_fmt {self.scale_fmt!r} is not one of {SCALE_FORMATS}")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> Fp8Config | None:
        """The fp8 layout config.json declares, or None for an unquantized checkpoint."""
        q = raw.get("quantization_config")
        if q is None:
            return None
        if not isinstance(q, dict):
            raise ConfigError(f"quantization_config must be an object, got {type(q).__name__}")
        if q.get("quant_method") != "fp8":
            raise ConfigError(f"quantization_config.quant_method {q.get('quant_method')!r}: lingjax reads fp8 "
                              "checkpoints (quant_method \"fp8\") only")
        if q.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"quantization_config.fmt {q.get('fmt')!r}: lingjax reads float8_e4m3fn weights "
                              "(\"e4m3\") only")
        lists = [q[key] for key in EXCLUSION_KEYS if q.get(key) is not None]
        for listed in lists:
            if not isinstance(listed, list) or not all(isinstance(m, str) for m in listed):
                raise ConfigError(f"quantization_config's {' / '.join(EXCLUSION_KEYS)} must be lists of module "
                                  f"names, got {listed!r}")
        if len(lists) == 2 and set(lists[0]) != set(lists[1]):
            raise ConfigError(f"quantization_config lists both {EXCLUSION_KEYS[0]} and {EXCLUSION_KEYS[1]}, and "
                              "they differ: which modules are unquantized is ambiguous")
        block = q.get("weight_block_size", list(BLOCK))
        if not isinstance(block, (list, tuple)):
            raise ConfigError(f"quantization_config.weight_block_size must be a list, got {block!r}")
        scale_fmt = q.get("scale_fmt") or "float32"
        return cls(block=tuple(block), scale_fmt=scale_fmt,
                   not_converted=tuple(lists[0]) if lists else None,
                   activation_scheme=str(q.get("activation_scheme", "dynamic")))

    def to_hf(self) -> dict[str, Any]:
        out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": self.activation_scheme,
               "weight_block_size": list(self.block)}
        if self.scale_fmt != "float32":
            out["scale_fmt"] = self.scale_fmt
        if self.not_converted is not None:
            out["modules_to_not_convert"] = list(self.not_converted)
        return out

    def excludes(self, module: str) -> bool:
        """Whether the config lists `module` (a tensor name without ".weight") as unquantized: an entry names it
        in full, or names its last components (a suffix at a dot boundary, e.g. "lm_head", "mlp.gate")."""
        return any(module == m or module.endswith("." + m) for m in self.not_converted or ())


# The model's matrix weights a quantizer converts (lingjax convert --fp8, random fp8 weights), by parameter name;
# the router (its choices are discrete), lm_head (the logits) and the embeddings stay as they are.
QUANTIZED_NAMES = frozenset({"in_proj", "b_proj", "o_proj", "q_proj", "kv_a_proj", "kv_b_proj", "g_proj",
                             "gate_proj", "up_proj", "down_proj", "w_gate", "w_up", "w_down", "eh_proj"})


@dataclasses.dataclass(frozen=True)
class Fp8Layout:
    """Which of a model's matrices live in fp8 on the device (lingjax.ops.fp8.Fp8Array), and their blocks.

    paths: the parameter paths (as lingjax.sharding.path_keys gives them, e.g. ("layers", 3, "mlp", "w_gate"));
    block: the checkpoint's (or the quantizer's) scale block; tp: the tensor-parallel size the device blocks are
    cut for (lingjax.ops.fp8.device_block: every shard holds whole blocks)."""

    paths: frozenset
    block: tuple[int, int] = BLOCK
    tp: int = 1
    scale_fmt: str = "float32"

    def device_block(self, path: tuple, shape: tuple[int, ...]) -> tuple[int, int]:
        """The (gn, gk) block of the weight at `path` of `shape` on the device at this layout's TP size."""

        spec = tuple(param_spec(path)) + (None,) * len(shape)
        sharded = spec[len(shape) - 2:len(shape)]
        return device_block(shape, self.block, tuple(self.tp if s is not None else 1 for s in sharded))


# The matrices the model's ops read whole as plain arrays (KDA's beta projection inside its chain kernel, MLA's head
# gate and kv_b_proj inside its attention): held in fp8, each would be dequantized in every step's graph, one launch
# and a bf16 copy a layer, to save a few MB. They stay dense on the device; an fp8 checkpoint's are dequantized once,
# as they load (the values the graph would have made). Writers still store them in fp8 (the official layout).
DENSE_ON_DEVICE = frozenset({"b_proj", "g_proj", "kv_b_proj"})


def held_in_fp8(path: tuple) -> bool:
    """Whether a parameter stored or quantized in fp8 is kept in fp8 on the device (not DENSE_ON_DEVICE)."""
    return path[-1] not in DENSE_ON_DEVICE


def quantized_paths(param_paths) -> frozenset:
    """The paths among `param_paths` a quantizing load keeps in fp8 on the device: QUANTIZED_NAMES but
    DENSE_ON_DEVICE."""
    return frozenset(tuple(p) for p in param_paths if p[-1] in QUANTIZED_NAMES and held_in_fp8(tuple(p)))
