"""FP8 for the wide dense layers (`--precision fp8`): `linear` (formats, row scales, `Fp8Linear`),
`product` and `kernels` (Triton), `wgrad` (fp8 weight gradients of the cross layers), `cross`
(`Fp8CrossNet`), and `apply` (`apply_fp8`, which rewrites a model with them). Imports run one way:
linear, product, kernels <- wgrad <- cross <- apply."""
