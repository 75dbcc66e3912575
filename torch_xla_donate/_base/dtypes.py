"""Short XLA spellings of torch dtypes, as XLA and JAX print them (``f32[2,3]``)."""
import torch

_XLA_NAMES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int8: "s8",
    torch.int16: "s16",
    torch.int32: "s32",
    torch.int64: "s64",
    torch.uint8: "u8",
    torch.bool: "pred",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def xla_dtype_name(dtype: torch.dtype) -> str:
    """The short name XLA uses for ``dtype``; falls back to torch's name.

    >>> xla_dtype_name(torch.bfloat16)
    'bf16'
    >>> xla_dtype_name(torch.float8_e4m3fn)
    'float8_e4m3fn'
    """
    name = _XLA_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def shape_string(t: torch.Tensor) -> str:
    """``t``'s dtype and shape as XLA prints them, the way every message of
    the plugin names a tensor.

    >>> shape_string(torch.zeros(2, 3, dtype=torch.bfloat16)), shape_string(torch.tensor(1))
    ('bf16[2,3]', 's64[]')
    """
    return f"{xla_dtype_name(t.dtype)}[{','.join(str(d) for d in t.shape)}]"

