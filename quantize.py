"""Weight-only quantized linear layers, attached by swapping modules (as gpt-fast's quantize.py).

Dimensions: M rows (batch x tokens), I input features, O output features, G group size.

`quantize` replaces a model's nn.Linear layers by modules that hold the same matrix in fewer
bits and call torch's weight-only kernels, in calls of a fixed number of rows (`kernel.RowCalls`:
kernel.py says why); the model's forward has no branch for them.

  float  the checkpoint's own matrices (on CPU: `FloatLinear`, rows in calls of a fixed size)
  int8   per output row: w = s * q, q in -127..127          (torch._weight_int8pack_mm)
  int4   per group of 32 inputs: w = d * q + m, q in 0..15  (torch._weight_int4pack_mm_for_cpu)

int4 is llama.cpp's Q4_1 block: the default model gets its file's blocks back (`int4_blocks`).
`load_quantized` keeps the packed form in a file beside the weights: packing is one-time work.
"""
import sys

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from kernel import RowCalls
from checkpoint import folder_config, load_model, save_tensors
from model import Llama

WEIGHTS = ("float", "int8", "int4")
GROUP = 32                                    # Q4_1's block length


class QuantizeError(ValueError):
    """A layer that the chosen form cannot hold; the message names it and the way out."""


class Int8Linear(RowCalls):
    """y = x W^T + b with W held as int8 rows and one scale per row; all rows in one call (why:
    kernel.py's docstring, checked at start: kernel.check_rows)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias=None):
        super().__init__()
        self.register_buffer("q", q)                                        # (O, I) int8
        self.register_buffer("scales", scales)                              # (O,)
        self.bias = bias

    @classmethod
    def of(cls, linear: nn.Linear) -> "Int8Linear":
        w = linear.weight.detach().float()                                  # (O, I)
        scales = w.abs().amax(1).clamp(min=1e-12) / 127                     # (O,)
        q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q, scales.to(linear.weight.dtype), linear.bias)

    def sizes(self) -> tuple:
        return self.q.shape[1], self.q.shape[0], self.scales.dtype

    def kernel(self, x):
        y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)     # (M, O)
        return y if self.bias is None else y + self.bias


def int4_blocks(w: torch.Tensor, group: int = GROUP) -> tuple:
    """(O, I) float weights -> d, m (O, I/G) and q (O, I) int32 in 0..15 with w ~ d q + m.

    For weights that are Q4_1 blocks (a block's q spans 0..15, as llama.cpp's quantizer
    makes it) this is the block: m its minimum, d = (max - min) / 15 (the file's float16 d
    once rounded to float16), q exact."""
    O, I = w.shape
    blocks = w.float().reshape(O, I // group, group)                       # (O, I/G, G)
    m = blocks.amin(-1, keepdim=True)
    d = (blocks.amax(-1, keepdim=True) - m) / 15
    q = ((blocks - m) / d.clamp(min=1e-30)).round().clamp(0, 15).to(torch.int32)
    return d.squeeze(-1), m.squeeze(-1), q.reshape(O, I)


class Int4Linear(RowCalls):
    """y = x W^T + b with W held as 4-bit groups: torch's CPU kernel, fast with bfloat16
    activations (float16 and float32 take its scalar path); all rows in one call, as Int8Linear."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, bias=None):
        super().__init__()
        self.group = GROUP
        self.register_buffer("packed", packed)                  # (O, I/2) uint8, two q a byte
        self.register_buffer("scales_zeros", scales_zeros)      # (I/G, O, 2)
        self.bias = bias

    @classmethod
    def of(cls, linear: nn.Linear) -> "Int4Linear":
        d, m, q = int4_blocks(linear.weight.detach())
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # the kernel's form: w = (q - 8) * scale + zero, as (I/G, O, 2)
        scales_zeros = torch.stack([d, m + 8 * d], -1).transpose(0, 1).contiguous()
        return cls(packed, scales_zeros.to(linear.weight.dtype), linear.bias)

    def sizes(self) -> tuple:
        return self.packed.shape[1] * 2, self.packed.shape[0], self.scales_zeros.dtype

    def kernel(self, x):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                       self.scales_zeros)   # (M, O)
        return y if self.bias is None else y + self.bias


# Rows a library call of float weights takes on CPU (kernel.in_calls; why: kernel.py's
# docstring): float32 one row a call, 16-bit floats blocks of 16 (oneDNN: 16 cost what 1 costs).
FLOAT_ROWS = {torch.float32: 1, torch.bfloat16: 16, torch.float16: 16}


class FloatLinear(RowCalls, nn.Linear):
    """nn.Linear on CPU, its rows in calls of FLOAT_ROWS[dtype] rows."""

    def sizes(self) -> tuple:
        return self.in_features, self.out_features, self.weight.dtype

    def kernel(self, x):
        return F.linear(x, self.weight, self.bias)


def as_float(linear: nn.Linear) -> nn.Module:
    """linear as a FloatLinear sharing its tensors, where FLOAT_ROWS names its dtype on CPU."""
    w = linear.weight
    if w.device.type not in ("cpu", "meta") or w.dtype not in FLOAT_ROWS:
        return linear
    layer = FloatLinear(linear.in_features, linear.out_features, linear.bias is not None,
                        device="meta")
    layer.weight, layer.bias, layer.rows = linear.weight, linear.bias, FLOAT_ROWS[w.dtype]
    return layer


def convert(linear: nn.Linear, form: str, name: str, rows: bool = True) -> nn.Module:
    """One layer in the chosen form; a QuantizeError where the form cannot hold it. rows=False:
    float weights stay nn.Linear, for a draft (its rounding never decides what is accepted, so
    its rows need not be the same bits in every call)."""
    w = linear.weight
    if form == "float":
        return as_float(linear) if rows else linear
    if w.device.type not in ("cpu", "meta"):
        raise QuantizeError(f"--weights {form}: layer {name} is on {w.device}; the weight-only "
                            f"kernels used here are torch's CPU ones: use --weights float")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise QuantizeError(f"--weights {form}: layer {name} is in {w.dtype}; the weight-only "
                            f"kernels take bfloat16, float16 or float32: use --weights float")
    if form == "int4" and w.shape[1] % GROUP:
        raise QuantizeError(f"--weights int4: layer {name} has {w.shape[1]} inputs, not a "
                            f"multiple of the group size {GROUP}: use --weights float or int8")
    kind = Int4Linear if form == "int4" else Int8Linear
    return kind.of(linear)         # on meta weights: the shapes a kept form is loaded into


def quantize(module: nn.Module, form: str, head_form: str | None = None,
             rows: bool = True) -> nn.Module:
    """Replace every nn.Linear in module (in place) by its `form`; a Llama's lm_head by
    `head_form` (default: form). The embedding stays as it is: a lookup reads one row. rows:
    see `convert`."""
    if form not in WEIGHTS or (head_form or form) not in WEIGHTS:
        raise QuantizeError(f"unknown weight form {form!r}: choose from {', '.join(WEIGHTS)}")
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                full = f"{parent_name}.{name}" if parent_name else name
                chosen = head_form or form if full == "lm_head" else form
                setattr(parent, name, convert(child, chosen, full, rows))
    return module


# ---------------------------------------------------------------- a kept quantized form

def load_quantized(folder: str, dtype, form: str, head_form: str, keep: str) -> Llama:
    """load_model(folder) on the CPU in `form` (lm_head in `head_form`), read from the file
    `keep` (a named artifact beside the weights, deleted to pack again) where it holds that form
    for this torch and instruction set; else packed here (most of a start) and written there."""
    stamp = {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
             "dtype": str(dtype), "forms": f"{form}/{head_form}"}
    model = read_kept(folder, keep, stamp, form, head_form)
    if model is None:
        print(f"Packing the model's {form} weights, once, into {keep}", file=sys.stderr)
        model = quantize(load_model(folder, dtype, "cpu"), form, head_form)
        try:                                      # whole or not at all
            save_tensors({k: v.contiguous() for k, v in model.state_dict().items()}, keep, stamp)
        except (OSError, SafetensorError):
            print(f"note: could not keep them in {keep}: the next start packs them again",
                  file=sys.stderr)
    return model


def read_kept(folder: str, keep: str, stamp: dict, form: str, head_form: str) -> Llama | None:
    """The model from a kept file made from `stamp`; None where there is none, or another."""
    try:
        with safe_open(keep, framework="pt") as f:
            if f.metadata() != stamp:
                return None
            # cloned: torch allocates aligned memory, which the kernels need (a tensor read
            # from the file need not be aligned; the int8 kernel crashes on one that is not)
            state = {name: f.get_tensor(name).clone() for name in f.keys()}
        with torch.device("meta"):
            model = quantize(Llama(folder_config(folder), init=False), form, head_form)
        model.load_state_dict(state, assign=True)
    except (OSError, SafetensorError, RuntimeError):     # unreadable, or not this model's form
        return None
    return model.eval()
