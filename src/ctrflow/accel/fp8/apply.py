"""`apply_fp8`: the large Linear layers of a model in fp8 (`Fp8Linear`, `ctrflow.accel.fp8.linear`'s module
doc says which products and why), and DCNv2's cross net in row kernels (`Fp8CrossNet`,
`ctrflow.accel.fp8.cross`)."""

from __future__ import annotations

from torch import nn

from ctrflow.accel.fp8.cross import Fp8CrossNet
from ctrflow.accel.fp8.linear import Fp8Linear
from ctrflow.models.layers import LowRankCrossNet


def apply_fp8(model: nn.Module, min_features: int = 512, rule: str = "all", fast_accum: bool = True,
              fuse_cross: bool = True, absorb: bool = True, **options) -> int:
    """Replace, in place, every plain `nn.Linear` of `model` with both widths >= `min_features` and
    multiples of 16 (the fp8 kernels' rule) by an `Fp8Linear` over the same parameters, its fp8
    products chosen by `rule` ("widening" or "all", `ctrflow.accel.fp8.linear`'s module doc; `options` as `Fp8Linear.set_options`);
    returns how many. Smaller layers stay bf16: their quantization passes would cost what fp8 saves.
    `fuse_cross`: DCNv2 cross layers whose products are now all fp8 with row scales become an
    `ctrflow.accel.fp8.cross.Fp8CrossNet` (their elementwise work and quantizations in row kernels),
    which also computes the deep MLP's first layer when it is such an `Fp8Linear` and `absorb`."""
    if rule not in ("widening", "all"):
        raise ValueError(f"unknown fp8 rule {rule!r}; choose widening or all")
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and min(m.in_features, m.out_features) >= min_features
               and m.in_features % 16 == 0 and m.out_features % 16 == 0]
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        products = {"fp8_forward": linear.out_features >= linear.in_features,
                    "fp8_dgrad": linear.in_features >= linear.out_features} if rule == "widening" else {}
        setattr(parent, leaf, Fp8Linear.from_linear(linear, fast_accum=fast_accum, **{**products, **options}))
    if fuse_cross:
        _fuse_crosses(model, absorb)
    return len(targets)


def _fuse_crosses(model: nn.Module, absorb: bool) -> None:
    """Cross nets whose products are all fp8 with row scales become `Fp8CrossNet`s: a ranking model's
    `interaction` part (DCNv2's), absorbing the first layer of its `over_arch` part (which reads the
    interaction's output: `ctrflow.models.base`'s named parts), or, in a module without those parts,
    every `LowRankCrossNet` found."""
    if hasattr(model, "interaction") and hasattr(model, "over_arch"):
        if type(model.interaction) is LowRankCrossNet and Fp8CrossNet.suits(model.interaction):
            model.interaction = cross = Fp8CrossNet.from_cross(model.interaction)
            first = model.over_arch[0]
            if absorb and (absorbed := cross.absorb(first)) is not None:
                model.over_arch[0] = absorbed
        return
    for name in [name for name, m in model.named_modules() if name and type(m) is LowRankCrossNet
                 and Fp8CrossNet.suits(m)]:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, Fp8CrossNet.from_cross(getattr(parent, leaf)))
