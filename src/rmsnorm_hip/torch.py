"""The torch adapter (docs/api.md, "Module rmsnorm_hip.torch"): differentiable :func:`rms_norm` and
:func:`fused_add_rms_norm`, the quantised forward :func:`rms_norm_quant`, :class:`RMSNorm` (a
drop-in for ``torch.nn.RMSNorm``, plus ``weight_offset``) and :func:`replace_rmsnorm`.

Each kernel entry point is a ``torch.library`` custom op in the namespace ``rmsnorm_hip``, with a
fake implementation and, for the differentiable ones, an autograd formula, so ``torch.compile(
fullgraph=True)`` traces them without graph breaks.  In eager mode, plain tensors skip the
dispatcher: the same op bodies and the same autograd formula run through a
``torch.autograd.Function`` (the custom op's Python autograd wrapper costs more host time than a
launch).  The bodies call :mod:`rmsnorm_hip.functional`, which allocates every output and
workspace with ``torch.empty`` (the caching allocator; inside a CUDA graph, its pool), launches
on torch's current stream of the tensor's device and never syncs the host, so both paths can be
captured in CUDA graphs.

The ops (``torch.ops.rmsnorm_hip.<name>``; ``weight?`` is an optional tensor):

- ``rms_norm(x, weight?, eps, weight_offset) -> y``
- ``rms_norm_fwd(x, weight?, eps, weight_offset) -> (y, rstd)``
- ``fused_add_rms_norm(x, residual, weight?, eps, weight_offset) -> (y, residual_out)``
- ``fused_add_rms_norm_fwd(x, residual, weight?, eps, weight_offset) -> (y, residual_out, rstd)``
- ``rms_norm_backward(dy, x, weight?, rstd?, dresidual?, eps, weight_offset) -> [dx]``, or
  ``[dx, dweight]`` with a weight
- ``rms_norm_quant(x, weight?, eps, xscale?, residual?, quant_dtype, weight_offset) ->
  [q, yscale]``, or ``[q, yscale, residual_out]`` with a residual
- ``rms_norm_quant_scaled(x, weight?, eps, xscale?, residual?, quant_dtype, weight_offset,
  group_size?, scale_format, scale_layout, scale?, scale_value?) -> [q, scales]`` (group and MX
  scales) or ``[q]`` (static), ``+ [residual_out]`` with a residual
- ``qk_rms_norm_(q!, k!, q_weight, k_weight, eps, weight_offset, positions?, cos_sin_cache?,
  rope_style, rotary_dim?) -> ()``: q and k declared mutated
- ``qk_rms_norm(q, k, q_weight, k_weight, eps, weight_offset, positions?, cos_sin_cache?,
  rope_style, rotary_dim?) -> (q_out, k_out)``
- ``rms_norm_gated(x, z, weight?, eps, weight_offset, group_size?, norm_before_gate) ->
  (y, rstd)``, differentiable (x, z, weight)
- ``rms_norm_gated_backward(dy, x, z, weight?, rstd, eps, weight_offset, group_size?,
  norm_before_gate) -> [dx, dz]``, or ``[dx, dz, dweight]`` with a weight

The ``*_fwd`` variants keep rstd for the backward; the wrappers call them only when a gradient is
needed (grad mode on and an input requiring grad).  Without rstd, the other forward ops' backward
recomputes it from x.  This is the only module of the package that imports torch.
"""
import math
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from . import _dtypes, _quant, _validate, functional, gated, qk

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_quant", "qk_rms_norm_", "qk_rms_norm",
           "rms_norm_gated", "RMSNorm", "RMSNormGated", "replace_rmsnorm"]

# torch.nn.RMSNorm's eps=None: the epsilon of the float32 opmath type for float32, float16 and
# bfloat16 inputs alike (not the 16-bit dtype's own epsilon)
TORCH_DEFAULT_EPS = torch.finfo(torch.float32).eps


# ---- layouts and devices -------------------------------------------------------------------------

def _rows(t, name, heads=False):
    """``t`` as the kernels read it: unchanged (no copy) when it is rows of unit-stride elements
    at one row stride (or with ``heads``, at two: a (T, H, D) view of a QKV buffer), else a
    contiguous copy.  Errors are left to functional's validation, which sees the tensor either
    way."""
    if t is None or t.is_contiguous():
        return t
    info = SimpleNamespace(shape=tuple(t.shape), strides=t.stride(), itemsize=t.element_size())
    try:
        split = _validate.row_split([info]) if heads else None
        if split is None:
            _validate.rows(info, "", name)
        else:
            _validate.head_rows(info, split, "", name)
    except ValueError:
        return t.contiguous()
    return t


def _vector(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


def _on_device(x):
    """The tensor's own device current for a launch on a CUDA device that is not torch's current
    one (restored after); otherwise nothing to do."""
    if x.is_cuda and x.get_device() != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return nullcontext()


def _rows_of(shape):
    return math.prod(shape[:-1])


# ---- forward ops ---------------------------------------------------------------------------------

def _forward(x, weight, eps, weight_offset, return_rstd):
    with _on_device(x):
        return functional.rms_norm(_rows(x, "x", heads=True), _vector(weight), eps,
                                   weight_offset=weight_offset, return_rstd=return_rstd)


@torch.library.custom_op("rmsnorm_hip::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float) -> Tensor:
    return _forward(x, weight, eps, weight_offset, False)


@torch.library.custom_op("rmsnorm_hip::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: Tensor, weight: Optional[Tensor], eps: float,
                     weight_offset: float) -> tuple[Tensor, Tensor]:
    return _forward(x, weight, eps, weight_offset, True)


@_rms_norm_op.register_fake
def _(x, weight, eps, weight_offset):
    return x.new_empty(x.shape)


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps, weight_offset):
    return x.new_empty(x.shape), x.new_empty((_rows_of(x.shape),), dtype=torch.float32)


def _fused(x, residual, weight, eps, weight_offset, return_rstd):
    with _on_device(x):
        return functional.fused_add_rms_norm(
            _rows(x, "x"), _rows(residual, "residual"), _vector(weight), eps,
            weight_offset=weight_offset, return_rstd=return_rstd)


@torch.library.custom_op("rmsnorm_hip::fused_add_rms_norm", mutates_args=())
def _fused_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
              weight_offset: float) -> tuple[Tensor, Tensor]:
    return _fused(x, residual, weight, eps, weight_offset, False)


@torch.library.custom_op("rmsnorm_hip::fused_add_rms_norm_fwd", mutates_args=())
def _fused_fwd_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                  weight_offset: float) -> tuple[Tensor, Tensor, Tensor]:
    return _fused(x, residual, weight, eps, weight_offset, True)


@_fused_op.register_fake
def _(x, residual, weight, eps, weight_offset):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@_fused_fwd_op.register_fake
def _(x, residual, weight, eps, weight_offset):
    return (x.new_empty(x.shape), x.new_empty(x.shape),
            x.new_empty((_rows_of(x.shape),), dtype=torch.float32))


@torch.library.custom_op("rmsnorm_hip::rms_norm_quant", mutates_args=())
def _quant_op(x: Tensor, weight: Optional[Tensor], eps: float, xscale: Optional[Tensor],
              residual: Optional[Tensor], quant_dtype: str, weight_offset: float) -> list[Tensor]:
    with _on_device(x):
        return list(functional.rms_norm_quant(
            _rows(x, "x"), _vector(weight), eps, xscale=_vector(xscale),
            residual=_rows(residual, "residual"), quant_dtype=quant_dtype,
            weight_offset=weight_offset))


@_quant_op.register_fake
def _(x, weight, eps, xscale, residual, quant_dtype, weight_offset):
    q_dtype = getattr(torch, _validate.quant_dtype(quant_dtype, "rms_norm_quant"))
    outs = [x.new_empty(x.shape, dtype=q_dtype),
            x.new_empty((_rows_of(x.shape),), dtype=torch.float32)]
    return outs if residual is None else outs + [x.new_empty(x.shape)]


@torch.library.custom_op("rmsnorm_hip::rms_norm_quant_scaled", mutates_args=())
def _quant_scaled_op(x: Tensor, weight: Optional[Tensor], eps: float, xscale: Optional[Tensor],
                     residual: Optional[Tensor], quant_dtype: str, weight_offset: float,
                     group_size: Optional[int], scale_format: str, scale_layout: str,
                     scale: Optional[Tensor], scale_value: Optional[float]) -> list[Tensor]:
    with _on_device(x):
        out = functional.rms_norm_quant(
            _rows(x, "x"), _vector(weight), eps, xscale=_vector(xscale),
            residual=_rows(residual, "residual"), quant_dtype=quant_dtype,
            weight_offset=weight_offset, group_size=group_size, scale_format=scale_format,
            scale_layout=scale_layout, scale=scale if scale is not None else scale_value)
    return list(out) if isinstance(out, tuple) else [out]


@_quant_scaled_op.register_fake
def _(x, weight, eps, xscale, residual, quant_dtype, weight_offset, group_size, scale_format,
      scale_layout, scale, scale_value):
    fn = "rms_norm_quant"
    quant = _validate.quant_dtype(quant_dtype, fn)
    n, m = x.shape[-1], _rows_of(x.shape)
    mx = quant in _quant.MX_FORMATS
    q_shape = x.shape[:-1] + ((n // 2,) if quant == "mxfp4_e2m1" else (n,))
    outs = [x.new_empty(q_shape, dtype=_quant.torch_dtype(torch, "q" + quant) or getattr(
        torch, quant))]
    if scale is None and scale_value is None:
        groups = n // (32 if mx else group_size or n)     # the real op refuses no group
        if mx:
            outs.append(x.new_empty((m, groups), dtype=_quant.torch_dtype(torch, "scales")))
        elif scale_layout == "column":
            pad = -(-m // _quant.COLUMN_PAD) * _quant.COLUMN_PAD
            outs.append(torch.empty_strided((m, groups), (1, pad), dtype=torch.float32,
                                            device=x.device))
        else:
            outs.append(x.new_empty((m, groups), dtype=torch.float32))
    return outs if residual is None else outs + [x.new_empty(x.shape)]


# ---- backward op and the autograd formula --------------------------------------------------------

def _backward_impl(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Optional[Tensor],
                   dresidual: Optional[Tensor], eps: float, weight_offset: float) -> list[Tensor]:
    x = _rows(x, "x", heads=True)
    dy, dresidual = (_split_like(t, x, name) for t, name in ((dy, "dy"),
                                                             (dresidual, "dresidual")))
    with _on_device(x):
        dx, dweight = functional.rms_norm_backward(
            dy, x, _vector(weight), _vector(rstd), weight_offset=weight_offset,
            dresidual=dresidual, eps=eps)
    return [dx] if dweight is None else [dx, dweight]


def _split_like(t, x, name):
    """``t`` (dy, dresidual) as the backward reads it beside ``x``: in place when its rows are
    at two strides that split the leading dims where x's do (or at one stride), else copied."""
    t = _rows(t, name, heads=True)
    if t is None or t.is_contiguous():
        return t
    infos = [SimpleNamespace(shape=tuple(a.shape), strides=a.stride(), itemsize=a.element_size())
             for a in (x, t)]
    split = _validate.row_split(infos)
    if split is None:
        return t
    try:
        _validate.head_rows(infos[1], split, "", name)
        _validate.head_rows(infos[0], split, "", "x")
    except ValueError:
        return t.contiguous()
    return t


_backward_op = torch.library.custom_op("rmsnorm_hip::rms_norm_backward",
                                       mutates_args=())(_backward_impl)


@_backward_op.register_fake
def _(dy, x, weight, rstd, dresidual, eps, weight_offset):
    dx = x.new_empty(x.shape)
    return [dx] if weight is None else [dx, weight.new_empty(weight.shape)]


def _save(ctx, h, weight, rstd, eps, weight_offset, fused, backward):
    """What the backward reads: the normalised input ``h`` (x, or a fused add's residual_out),
    weight, rstd (None: recomputed from h) and the backward to call (the op, or its body)."""
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h, weight, rstd)
    ctx.eps, ctx.weight_offset, ctx.fused, ctx.backward_fn = eps, weight_offset, fused, backward


def _backward(ctx, dy, *rest):
    """Gradients of (x, weight, eps, weight_offset), or of (x, residual, weight, eps,
    weight_offset) for the fused add, whose ``rest[0]`` is the gradient reaching residual_out:
    the kernel folds it into dx (one rounding), and that one tensor is the gradient of both x
    and residual (residual_out = x + residual), with no copy.  Further grads (rstd's) are None."""
    h, weight, rstd = ctx.saved_tensors
    dresidual = rest[0] if ctx.fused else None
    # a backward that builds a graph (create_graph=True) goes through the op, which has no
    # derivative: a second derivative through it raises, never comes back without the graph
    backward = _backward_op if torch.is_grad_enabled() else ctx.backward_fn
    if dy is None:
        dh, dweight = dresidual, None
    else:
        dh, *dweight = backward(dy, h, weight, rstd, dresidual, ctx.eps, ctx.weight_offset)
        # weight is the third input from the end in both signatures
        dweight = dweight[0] if dweight and ctx.needs_input_grad[-3] else None
    return (dh, dh, dweight, None, None) if ctx.fused else (dh, dweight, None, None)


def _setup_op(ctx, inputs, output):
    fused = len(inputs) == 5
    weight, eps, weight_offset = inputs[-3:]
    outputs = output if isinstance(output, tuple) else (output,)
    rstd = outputs[-1] if len(outputs) == (3 if fused else 2) else None
    if rstd is not None:
        ctx.mark_non_differentiable(rstd)
    _save(ctx, outputs[1] if fused else inputs[0], weight, rstd, eps, weight_offset, fused,
          _backward_op)


for _op in (_rms_norm_op, _rms_norm_fwd_op, _fused_op, _fused_fwd_op):
    _op.register_autograd(_backward, setup_context=_setup_op)


def _setup_quant(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)    # integer / float8 codes: no gradient flows


_quant_op.register_autograd(lambda ctx, *grads: (None,) * 7, setup_context=_setup_quant)
_quant_scaled_op.register_autograd(lambda ctx, *grads: (None,) * 12,
                                   setup_context=_setup_quant)


class _RMSNormFunction(torch.autograd.Function):
    """The eager path of :func:`rms_norm` with a gradient: the op bodies called directly (the
    dispatcher and the custom op's autograd wrapper cost more host time than the launch)."""

    @staticmethod
    def forward(ctx, x, weight, eps, weight_offset):
        y, rstd = _forward(x, weight, eps, weight_offset, True)
        _save(ctx, x, weight, rstd, eps, weight_offset, False, _backward_impl)
        return y

    backward = staticmethod(_backward)


class _FusedFunction(torch.autograd.Function):
    """The eager path of :func:`fused_add_rms_norm` with a gradient."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, weight_offset):
        y, residual_out, rstd = _fused(x, residual, weight, eps, weight_offset, True)
        _save(ctx, residual_out, weight, rstd, eps, weight_offset, True, _backward_impl)
        return y, residual_out

    backward = staticmethod(_backward)


# ---- the functions users call --------------------------------------------------------------------

_ops = torch.ops.rmsnorm_hip


def _check_tensors(fn, required=("x",), **tensors):
    for name, t in tensors.items():
        if (t is not None or name in required) and not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor"
                            f"{'' if name in required else ' or None'}, "
                            f"got {type(t).__module__}.{type(t).__qualname__}")


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _scalars(fn, eps, weight_offset, has_weight):
    """eps and weight_offset for the ops' float arguments: checked here (functional's messages)
    in eager mode; under torch.compile passed on as traced, and checked by functional when the
    compiled graph runs."""
    if torch.compiler.is_compiling():
        return eps, weight_offset
    return _validate.eps(eps, fn), _validate.weight_offset(weight_offset, has_weight, fn)


_PLAIN = (Tensor, torch.nn.Parameter)


def _direct(x):
    """Whether a call may skip the dispatcher: eager mode and a plain tensor with storage.  Under
    torch.compile, and for meta / fake tensors and tensor subclasses, the custom ops run."""
    return not torch.compiler.is_compiling() and type(x) in _PLAIN and not x.is_meta


def rms_norm(x, weight=None, eps=1e-6, weight_offset=0.0):
    """Differentiable :func:`rmsnorm_hip.rms_norm` for torch tensors (grads for x and weight).

    ``y = x * rstd * (weight + weight_offset)``, ``rstd = 1 / sqrt(mean(x**2) + eps)`` over the
    last dimension, in float32 with one rounding to x's dtype.  rstd is kept for the backward
    only when a gradient is needed.  Any layout is accepted: tensors whose rows are not
    unit-stride rows of one row stride are made contiguous first; row-strided ones are read in
    place.  CPU tensors run on the CPU backend; CUDA tensors on their own device and on torch's
    current stream there.
    """
    fn = "rms_norm"
    _check_tensors(fn, x=x, weight=weight)
    grad = _needs_grad(x, weight)
    if _direct(x):                  # functional validates eps and weight_offset
        if grad:
            return _RMSNormFunction.apply(x, weight, eps, weight_offset)
        return _forward(x, weight, eps, weight_offset, False)
    eps, weight_offset = _scalars(fn, eps, weight_offset, weight is not None)
    if grad:
        return _ops.rms_norm_fwd.default(x, weight, eps, weight_offset)[0]
    return _ops.rms_norm.default(x, weight, eps, weight_offset)


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, weight_offset=0.0):
    """Differentiable :func:`rmsnorm_hip.fused_add_rms_norm`: ``(y, residual_out)`` with
    ``residual_out = round(x + residual)`` and ``y = rms_norm(residual_out, weight, eps,
    weight_offset)`` (grads for x, residual and weight).

    The backward folds the gradient reaching ``residual_out`` into the kernel's dx (one
    rounding) and returns that one tensor as the gradient of both x and residual.
    """
    fn = "fused_add_rms_norm"
    _check_tensors(fn, ("x", "residual"), x=x, residual=residual, weight=weight)
    grad = _needs_grad(x, residual, weight)
    if _direct(x):
        if grad:
            return _FusedFunction.apply(x, residual, weight, eps, weight_offset)
        return _fused(x, residual, weight, eps, weight_offset, False)
    eps, weight_offset = _scalars(fn, eps, weight_offset, weight is not None)
    if grad:
        return _ops.fused_add_rms_norm_fwd.default(x, residual, weight, eps, weight_offset)[:2]
    return _ops.fused_add_rms_norm.default(x, residual, weight, eps, weight_offset)


def rms_norm_quant(x, weight=None, eps=1e-6, *, xscale=None, residual=None, quant_dtype="int8",
                   weight_offset=0.0, group_size=None, scale_format="float32",
                   scale_layout="row", scale=None):
    """:func:`rmsnorm_hip.rms_norm_quant` as a custom op (traceable; not differentiable):
    ``(q, yscale)``, or ``(q, yscale, residual_out)`` when residual is given; with a static
    ``scale``, ``q`` or ``(q, residual_out)``.  ``quant_dtype``: "int8" / "float8_e4m3fn" (or
    ``torch.int8`` / ``torch.float8_e4m3fn``), "mxfp8_e4m3" / "mxfp4_e2m1".  MX outputs come as
    ``torch.float8_e4m3fn`` / ``torch.float4_e2m1fn_x2`` and ``torch.float8_e8m0fnu`` scales
    (uint8 where this torch lacks them); ``scale_layout="column"`` scales as a column-major view.
    ``scale``: a float32 tensor of one element on x's device, or a positive number (passed to
    the kernel by value)."""
    fn = "rms_norm_quant"
    scale_tensor = scale if isinstance(scale, Tensor) else None
    _check_tensors(fn, x=x, weight=weight, xscale=xscale, residual=residual, scale=scale_tensor)
    quant_dtype = _validate.quant_dtype(quant_dtype, fn)
    eps, weight_offset = _scalars(fn, eps, weight_offset, weight is not None)
    if not _quant.wants_scaled(quant_dtype, group_size, scale_format, scale_layout, scale):
        return tuple(_ops.rms_norm_quant.default(x, weight, eps, xscale, residual, quant_dtype,
                                                 weight_offset))
    scale_value = None
    if scale is not None and scale_tensor is None:
        if not _quant.is_number(scale):
            raise TypeError(f"{fn}: scale must be a number or a float32 torch.Tensor of one "
                            f"element, got {type(scale).__module__}.{type(scale).__qualname__}")
        scale_value = _quant.scale_number(scale, fn)
    n = x.shape[-1] if x.dim() else 0
    _quant.scheme(fn, quant_dtype, n, group_size, scale_format, scale_layout, scale)
    out = _ops.rms_norm_quant_scaled.default(
        x, weight, eps, xscale, residual, quant_dtype, weight_offset,
        None if group_size is None else int(group_size), scale_format, scale_layout,
        scale_tensor, scale_value)
    return out[0] if len(out) == 1 else tuple(out)


def _qk_args(q, k, q_weight, k_weight, eps, weight_offset, positions, cos_sin_cache, rope_style,
             rotary_dim):
    return dict(q=q, k=k, q_weight=q_weight, k_weight=k_weight, eps=eps,
                weight_offset=weight_offset, positions=positions, cos_sin_cache=cos_sin_cache,
                rope_style=rope_style, rotary_dim=rotary_dim)


@torch.library.custom_op("rmsnorm_hip::qk_rms_norm_", mutates_args=("q", "k"))
def _qk_inplace_op(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                   weight_offset: float, positions: Optional[Tensor],
                   cos_sin_cache: Optional[Tensor], rope_style: str,
                   rotary_dim: Optional[int]) -> None:
    with _on_device(q):
        qk.qk_rms_norm_(**_qk_args(q, k, q_weight, k_weight, eps, weight_offset, positions,
                                   cos_sin_cache, rope_style, rotary_dim))


@_qk_inplace_op.register_fake
def _(q, k, q_weight, k_weight, eps, weight_offset, positions, cos_sin_cache, rope_style,
      rotary_dim):
    return None


@torch.library.custom_op("rmsnorm_hip::qk_rms_norm", mutates_args=())
def _qk_op(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
           weight_offset: float, positions: Optional[Tensor], cos_sin_cache: Optional[Tensor],
           rope_style: str, rotary_dim: Optional[int]) -> tuple[Tensor, Tensor]:
    with _on_device(q):
        return qk.qk_rms_norm(**_qk_args(q, k, q_weight, k_weight, eps, weight_offset, positions,
                                         cos_sin_cache, rope_style, rotary_dim))


@_qk_op.register_fake
def _(q, k, q_weight, k_weight, eps, weight_offset, positions, cos_sin_cache, rope_style,
      rotary_dim):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup_qk(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)    # no backward: the outputs carry no gradient


_qk_op.register_autograd(lambda ctx, *grads: (None,) * 10, setup_context=_setup_qk)


def _refuse_grad(fn, q, k):
    """QK-norm has no backward: an in-place call on tensors autograd tracks would leave their
    gradients silently wrong, so it is refused (training: rms_norm on the head views)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise ValueError(f"{fn}: q and k must not require grad (QK-norm has no backward; "
                         f"for training call rmsnorm_hip.torch.rms_norm on the head views, or "
                         f"run under torch.no_grad()), got q.requires_grad={q.requires_grad}, "
                         f"k.requires_grad={k.requires_grad}")


def qk_rms_norm_(q, k, q_weight, k_weight, eps=1e-6, *, weight_offset=0.0, positions=None,
                 cos_sin_cache=None, rope_style="neox", rotary_dim=None):
    """:func:`rmsnorm_hip.qk_rms_norm_` as a custom op declaring q and k mutated (traceable by
    torch.compile, capturable in CUDA graphs; not differentiable).  q and k may be views into
    one QKV tensor.  Returns None."""
    fn = "qk_rms_norm_"
    _check_tensors(fn, ("q", "k", "q_weight", "k_weight"), q=q, k=k, q_weight=q_weight,
                   k_weight=k_weight, positions=positions, cos_sin_cache=cos_sin_cache)
    _refuse_grad(fn, q, k)
    if _direct(q):
        with _on_device(q):
            qk.qk_rms_norm_(q, k, q_weight, k_weight, eps, weight_offset=weight_offset,
                            positions=positions, cos_sin_cache=cos_sin_cache,
                            rope_style=rope_style, rotary_dim=rotary_dim)
        return None
    eps, weight_offset = _scalars(fn, eps, weight_offset, True)
    _ops.qk_rms_norm_.default(q, k, q_weight, k_weight, eps, weight_offset, positions,
                              cos_sin_cache, rope_style, rotary_dim)
    return None


def qk_rms_norm(q, k, q_weight, k_weight, eps=1e-6, *, weight_offset=0.0, positions=None,
                cos_sin_cache=None, rope_style="neox", rotary_dim=None):
    """:func:`rmsnorm_hip.qk_rms_norm` as a custom op: ``(q_out, k_out)``, contiguous (not
    differentiable; for QK-norm with autograd, call :func:`rms_norm` on the head views)."""
    fn = "qk_rms_norm"
    _check_tensors(fn, ("q", "k", "q_weight", "k_weight"), q=q, k=k, q_weight=q_weight,
                   k_weight=k_weight, positions=positions, cos_sin_cache=cos_sin_cache)
    eps, weight_offset = _scalars(fn, eps, weight_offset, True)
    return tuple(_ops.qk_rms_norm.default(q, k, q_weight, k_weight, eps, weight_offset,
                                          positions, cos_sin_cache, rope_style, rotary_dim))


# ---- gated RMSNorm -------------------------------------------------------------------------------

@torch.library.custom_op("rmsnorm_hip::rms_norm_gated", mutates_args=())
def _gated_op(x: Tensor, z: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
              group_size: Optional[int], norm_before_gate: bool) -> tuple[Tensor, Tensor]:
    with _on_device(x):
        return gated.rms_norm_gated(_contiguous_rows(x), _contiguous_rows(z), _vector(weight), eps,
                                    group_size=group_size, norm_before_gate=norm_before_gate,
                                    weight_offset=weight_offset, return_rstd=True)


@_gated_op.register_fake
def _(x, z, weight, eps, weight_offset, group_size, norm_before_gate):
    m = _rows_of(x.shape)
    shape = (m,) if group_size is None else (m, x.shape[-1] // group_size)
    return x.new_empty(x.shape), x.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("rmsnorm_hip::rms_norm_gated_backward", mutates_args=())
def _gated_backward_op(dy: Tensor, x: Tensor, z: Tensor, weight: Optional[Tensor], rstd: Tensor,
                       eps: float, weight_offset: float, group_size: Optional[int],
                       norm_before_gate: bool) -> list[Tensor]:
    with _on_device(x):
        dx, dz, dweight = gated.rms_norm_gated_backward(
            _contiguous_rows(dy), _contiguous_rows(x), _contiguous_rows(z), _vector(weight),
            _vector(rstd), group_size=group_size, norm_before_gate=norm_before_gate,
            weight_offset=weight_offset, eps=eps)
    return [dx, dz] if dweight is None else [dx, dz, dweight]


@_gated_backward_op.register_fake
def _(dy, x, z, weight, rstd, eps, weight_offset, group_size, norm_before_gate):
    out = [x.new_empty(x.shape), x.new_empty(x.shape)]
    return out if weight is None else out + [weight.new_empty(weight.shape)]


def _setup_gated(ctx, inputs, output):
    x, z, weight, eps, weight_offset, group_size, norm_before_gate = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, z, weight, output[1])
    ctx.args = (eps, weight_offset, group_size, norm_before_gate)


def _gated_backward(ctx, dy, _):
    x, z, weight, rstd = ctx.saved_tensors
    if dy is None:
        return (None,) * 7
    dx, dz, *dweight = _ops.rms_norm_gated_backward.default(dy, x, z, weight, rstd, *ctx.args)
    dweight = dweight[0] if dweight and ctx.needs_input_grad[2] else None
    return dx, dz, dweight, None, None, None, None


_gated_op.register_autograd(_gated_backward, setup_context=_setup_gated)


def _contiguous_rows(t):
    """The gated kernels' rows are at one row stride: anything else is made contiguous."""
    return _rows(t, "x")


def rms_norm_gated(x, z, weight=None, eps=1e-6, *, group_size=None, norm_before_gate=False,
                   weight_offset=0.0):
    """Differentiable :func:`rmsnorm_hip.rms_norm_gated` (grads for x, z and weight), a custom
    op (torch.compile, CUDA graphs): Mamba 2's gated RMSNorm, ``norm_before_gate=False`` by
    default as in Mamba 2's blocks.  Returns y."""
    fn = "rms_norm_gated"
    _check_tensors(fn, ("x", "z"), x=x, z=z, weight=weight)
    eps, weight_offset = _scalars(fn, eps, weight_offset, weight is not None)
    return _ops.rms_norm_gated.default(x, z, weight, eps, weight_offset, group_size,
                                       bool(norm_before_gate))[0]


class RMSNormGated(torch.nn.Module):
    """mamba_ssm's ``RMSNormGated`` on the rmsnorm_hip kernels: the same constructor, defaults
    (``eps=1e-5``, ``norm_before_gate=True``), ``weight`` parameter (ones) and state_dict.
    ``forward(x, z=None)``: gated by z, or without z an RMSNorm of each group (of the whole row
    without ``group_size``), as mamba_ssm's."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True,
                 device=None, dtype=None):
        super().__init__()
        if group_size is not None:
            gated._group_size(group_size, hidden_size, "RMSNormGated")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        _check_tensors("RMSNormGated", x=x)
        if z is None:
            if self.group_size is None:
                return rms_norm(x, self.weight, self.eps)
            # each group a row of its own, normalised in float32; then the weight, which differs
            # across groups, and one rounding to x's dtype.  x and the weight as the kernels
            # take them (the float32 copy would take any dtype)
            g, n = self.group_size, self.weight.shape[0]
            if x.dim() == 0 or x.shape[-1] != n:
                raise ValueError(f"RMSNormGated: x must have shape (..., {n}), got "
                                 f"{tuple(x.shape)}")
            x_dtype, w_dtype = (str(t.dtype).removeprefix("torch.") for t in (x, self.weight))
            if (x_dtype not in _dtypes.ACTIVATION_DTYPES
                    or w_dtype not in _validate.weight_dtypes(x_dtype)):
                raise TypeError(f"RMSNormGated: x must be float32, float16 or bfloat16 and the "
                                f"weight of x's dtype or float32, got x {x.dtype}, weight "
                                f"{self.weight.dtype}")
            y = rms_norm(x.float().unflatten(-1, (n // g, g)), None, self.eps).flatten(-2)
            return (y * self.weight.float()).to(x.dtype)
        return rms_norm_gated(x, z, self.weight, self.eps, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate)

    def extra_repr(self):
        return (f"{self.weight.shape[0]}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}")


# ---- modules -------------------------------------------------------------------------------------

class RMSNorm(torch.nn.RMSNorm):
    """A drop-in for ``torch.nn.RMSNorm`` running the rmsnorm_hip kernels (a subclass of it:
    same constructor and defaults, attributes, ``weight`` parameter and state_dict keys).

    Normalises over the trailing ``normalized_shape`` dims (flattened into one row of N
    elements).  ``eps=None`` uses float32's epsilon, as torch does for float32, float16 and
    bfloat16 inputs.  ``weight_offset`` (keyword only) scales by ``weight + weight_offset``
    (1.0: Gemma's ``1 + w``); the weight then starts at ``1 - weight_offset``, the identity.

    The output keeps x's dtype whatever the weight's (a float32 weight with bfloat16 x gives
    bfloat16, where some torch versions promote to float32), rounded once; float64 inputs raise
    TypeError.
    """

    __constants__ = torch.nn.RMSNorm.__constants__ + ["weight_offset"]

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                 dtype=None, *, weight_offset=0.0):
        weight_offset = _validate.weight_offset(weight_offset, True, "RMSNorm")
        if weight_offset and not elementwise_affine:
            raise ValueError(f"RMSNorm: weight_offset must be 0.0 with elementwise_affine=False "
                             f"(no weight), got {weight_offset}")
        self.weight_offset = weight_offset      # before super().__init__: reset_parameters reads it
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        if not self.normalized_shape:
            raise ValueError("RMSNorm: normalized_shape must have at least one dimension, got ()")

    def reset_parameters(self):
        if self.elementwise_affine:
            torch.nn.init.constant_(self.weight, 1.0 - self.weight_offset)

    def forward(self, x):
        shape = self.normalized_shape
        k = len(shape)
        _check_tensors("RMSNorm", x=x)
        if x.dim() < k or tuple(x.shape[x.dim() - k:]) != shape:
            got = tuple(x.shape)
            raise ValueError(f"RMSNorm: x must have shape (..., {', '.join(map(str, shape))}) "
                             f"(normalized_shape {shape}), got {got}")
        eps = TORCH_DEFAULT_EPS if self.eps is None else self.eps
        if k == 1:
            return rms_norm(x, self.weight, eps, self.weight_offset)
        n = math.prod(shape)
        weight = None if self.weight is None else self.weight.reshape(n)
        y = rms_norm(x.reshape(x.shape[:x.dim() - k] + (n,)), weight, eps, self.weight_offset)
        return y.reshape(x.shape)

    def extra_repr(self):
        text = super().extra_repr()
        return text + f", weight_offset={self.weight_offset}" if self.weight_offset else text


def replace_rmsnorm(model):
    """Swaps every ``torch.nn.RMSNorm`` inside ``model`` (exactly that class, not subclasses) for
    :class:`RMSNorm`, in place, and returns ``model`` (or the new module when ``model`` is itself
    a ``torch.nn.RMSNorm``).

    The new module takes over the old one's ``weight`` parameter object (same storage, device,
    dtype and requires_grad, so an optimizer built before the swap still updates it), its
    ``normalized_shape``, ``eps``, ``elementwise_affine`` and training mode.  A module reached
    by several paths is replaced by one new module.  Hooks registered on the old modules are
    not carried over.
    """
    return _replace(model, {})


def _replace(module, done):
    if type(module) is torch.nn.RMSNorm:
        if id(module) not in done:
            new = RMSNorm(module.normalized_shape, module.eps, module.elementwise_affine,
                          device="meta")
            if module.elementwise_affine:
                new.weight = module.weight
            new.train(module.training)
            done[id(module)] = new
        return done[id(module)]
    for name, child in module.named_children():
        new = _replace(child, done)
        if new is not child:
            setattr(module, name, new)
    return module
