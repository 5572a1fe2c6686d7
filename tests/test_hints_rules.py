"""The rules of ``nanguard._hints.hint``: each pinned by its key words, then their priority."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from torch import nn

import nanguard
from nanguard import TensorStats
from nanguard._hints import HintContext, OpInfo, hint, learning_rate_note

INF = math.inf
NAN = math.nan
MAX_LEN = 300


def st(*values: float, dtype: torch.dtype = torch.float32) -> TensorStats:
    return TensorStats.of(torch.tensor(values, dtype=dtype))


def op(
    name: str,
    *inputs: TensorStats | None,
    output: TensorStats | None = None,
    node: str | None = None,
    args: tuple[object, ...] = (),
) -> OpInfo:
    direction = "backward" if node else "forward"
    return OpInfo(name, tuple(inputs), output, direction=direction, node=node, args=args)


def fwd(kind: str, o: OpInfo | None = None, **kw: object) -> HintContext:
    return HintContext(phase="forward", kind=kind, reason="output", op=o, **kw)  # type: ignore[arg-type]


def bwd(kind: str, node: str, name: str = "aten.mul.Tensor") -> HintContext:
    o = op(name, st(1.0), st(0.0), node=node)
    return HintContext(phase="backward", kind=kind, reason="backward", op=o)


F16 = torch.float16
BF16 = torch.bfloat16
UNKNOWN = "nanguard does not recognise this pattern"

# (context, words the hint must contain, words it must not contain)
CASES = [
    # --- the data --------------------------------------------------------------------
    pytest.param(
        HintContext(phase="input", kind="nan", reason="input", stats=st(NAN, 1.0)),
        ["data pipeline", "NaN", "corrupt sample"],
        [UNKNOWN],
        id="input-nan",
    ),
    pytest.param(
        HintContext(phase="forward", kind="nan", reason="output", params_nonfinite=True),
        ["weights were already non-finite", "checkpoint", "'param' event"],
        [],
        id="corrupt-weights",
    ),
    # --- half-precision overflow ----------------------------------------------------
    pytest.param(
        fwd("inf", op("aten.mm.default", st(300.0, -2.0, dtype=F16), st(250.0, 1.0, dtype=F16))),
        ["aten.mm.default", "float16", "65504", "bfloat16", "float32", "scale"],
        ["NaN"],
        id="fp16-mm-overflow",
    ),
    pytest.param(
        # timm's DropPath at drop_prob=1.0 (a stochastic-depth schedule): x.div(keep_prob=0.0)
        fwd("nan", op("aten.div.Tensor", st(1.0, -2.0), args=(0.0,))),
        ["divided by the number 0", "DropPath", "an eps is the wrong fix"],
        ["Add an eps to the denominator"],
        id="division-by-the-python-number-0",
    ),
    pytest.param(
        # StyleGAN2's demodulation rsqrt(sum w^2 + 1e-8) in float16: the eps rounds away.
        fwd("inf", op("aten.rsqrt.default", st(0.0, 7e-7, dtype=F16)), dtype="torch.float16"),
        ["rsqrt of 0 in float16", "6e-8", "rounds away", "float32"],
        ["Add an eps inside"],
        id="fp16-rsqrt-eps-rounds-away",
    ),
    pytest.param(
        fwd("inf", op("aten.gelu.default", st(30000.0, 1.0, dtype=F16))),
        ["float16", "65504", "3e+04"],
        [UNKNOWN],
        id="fp16-large-input-any-op",
    ),
    pytest.param(
        fwd("nan", op("aten.addmm.default", st(1.0, dtype=F16), st(200.0, dtype=F16))),
        ["65504", "inf - inf"],
        [],
        id="fp16-inf-minus-inf",
    ),
    pytest.param(
        fwd("inf", op("aten.bmm.default", st(3e37, 1.0, dtype=BF16), st(20.0, dtype=BF16))),
        ["overflowed bfloat16", "3.39e+38", "exploding", "Lower the learning rate"],
        ["float32", "Use bfloat16", "65504"],  # float32 has bfloat16's range
        id="bf16-overflow",
    ),
    pytest.param(
        # DLRM's dot interaction of embeddings blown up by a huge learning rate two steps
        # after the gradient norm spiked: the hint ties the overflow to that spike.
        fwd(
            "inf",
            op("aten.bmm.default", st(1.5e29, -2.0), st(1.5e29, 3.0), output=st(INF, 1.0)),
            grad_norm_alarm_step=1,
            step=3,
        ),
        ["overflowed float32", "gradient-norm spike at step 1, 2 steps earlier", "warm-up"],
        ["normalise the activations"],
        id="overflow-after-grad-norm-spike",
    ),
    pytest.param(
        # A BatchNorm whose batch sum overflowed, with no op from the replay: its inputs say it.
        fwd("nan", stats=st(0.0, NAN), call_inputs=(st(-3e38, 2.7e38),)),
        ["inputs reaching 3e+38", "overflowed float32", "exploding"],
        ["does not recognise"],
        id="overflow-from-call-inputs-no-op",
    ),
    pytest.param(
        fwd("inf", stats=st(60000.0, INF, dtype=F16)),
        ["finite values up to 6e+04", "65504"],
        [],
        id="fp16-overflow-no-op",
    ),
    pytest.param(
        fwd("inf", op("aten.pow.Tensor_Scalar", st(300.0, 2.0, dtype=F16), args=(2,))),
        ["65504"],
        ["negative power"],
        id="fp16-pow-overflow",
    ),
    pytest.param(
        fwd("inf", op("aten.div.Tensor", st(5.0, 1.0, dtype=F16), st(0.001, 0.5, dtype=F16))),
        ["as small as 0.001", "overflowed float16"],
        ["divided by zero"],
        id="fp16-div-overflow",
    ),
    pytest.param(
        fwd("inf", op("aten.exp.default", st(100.0, 1.0))),
        ["float32", "88.72", "[1, 100]", "log space"],
        [],
        id="fp32-exp-overflow",
    ),
    pytest.param(
        fwd("inf", op("aten.mul.Tensor", st(1e20), st(1e20))),
        ["float32", "exploding", "learning rate"],
        [],
        id="fp32-mul-overflow",
    ),
    # --- masked softmax / attention --------------------------------------------------
    pytest.param(
        fwd("nan", op("aten._softmax.default", st(-INF, -INF, 2.0), args=(-1, False))),
        ["aten._softmax.default", "fully masked", "-inf", "finfo"],
        [],
        id="softmax-all-masked-row",
    ),
    pytest.param(
        fwd("nan", op("aten.scaled_dot_product_attention.default", st(1.0), st(1.0), st(1.0))),
        ["fully masked", "empty sequence"],
        [],
        id="sdpa-nan",
    ),
    pytest.param(
        fwd("nan", mask_inputs=True, module_type="MultiheadAttention"),
        ["fully masked", "padding mask"],
        [],
        id="mask-inputs-no-op",
    ),
    pytest.param(
        # torch's MultiheadAttention fills what a bool key_padding_mask hides itself: no
        # fill value for the user to choose.
        fwd(
            "nan",
            op("aten._native_multi_head_attention.default", st(1.0), st(1.0), st(1.0)),
            mask_inputs=True,
            module_type="MultiheadAttention",
        ),
        ["fully masked", "padding mask is all True", "Drop such samples"],
        ["finfo"],
        id="torch-mha-fused-masked-row",
    ),
    pytest.param(
        fwd(
            "nan",
            op("aten._scaled_dot_product_flash_attention.default", st(20000.0, dtype=F16)),
        ),
        ["65504"],
        ["fully masked"],
        id="fp16-sdpa-large-inputs-unmasked",
    ),
    pytest.param(
        fwd("nan", op("aten._softmax.default", st(20000.0, -INF, dtype=F16))),
        ["fully masked"],
        ["65504"],
        id="fp16-softmax-masked-beats-overflow",
    ),
    pytest.param(
        # Unscaled float16 q @ k^T: the scores hold +Inf (and -Inf), no mask at all.
        fwd("nan", op("aten._softmax.default", st(INF, -INF, 3.0, dtype=F16))),
        ["overflowed before the softmax", "65504", "1/sqrt(head_dim)"],
        ["fully masked"],
        id="fp16-softmax-of-overflowed-scores",
    ),
    # --- out-of-domain math, forward -------------------------------------------------
    pytest.param(
        fwd("inf", op("aten.log.default", st(0.0, 1.0), output=st(-INF, 0.0))),
        ["log of", "<= 0", "[0, 1]", "-Inf", "clamp_min", "log_softmax"],
        [],
        id="log-of-zero",
    ),
    pytest.param(
        fwd("nan", op("aten.log2.default", st(-0.5, 2.0))),
        ["log of", "-0.5"],
        [],
        id="log2-negative",
    ),
    pytest.param(
        fwd("nan", op("aten.log1p.default", st(-1.5, 2.0))),
        ["log(1 + x) of a value x <= -1", "-1.5"],
        [],
        id="log1p",
    ),
    pytest.param(
        fwd("nan", op("aten.sqrt.default", st(-0.01, 4.0))),
        ["sqrt of a negative", "-0.01", "clamp_min(1e-12)", "not to 0"],
        [],
        id="sqrt-negative",
    ),
    pytest.param(
        fwd("inf", op("aten.rsqrt.default", st(0.0, 4.0))),
        ["rsqrt", "<= 0", "eps"],
        [],
        id="rsqrt-zero",
    ),
    pytest.param(
        # A one-pass variance E[x^2] - E[x]^2 in bfloat16 that cancelled to -4.
        fwd("nan", op("aten.rsqrt.default", st(-4.0, 4.0, dtype=BF16)), dtype="torch.bfloat16"),
        ["rsqrt of a negative value", "cancellation", "E[x^2] - E[x]^2 in bfloat16", "float32"],
        ["Add an eps inside", "rsqrt of 0"],
        id="bf16-rsqrt-of-a-cancelled-variance",
    ),
    pytest.param(
        # a raw learned precision the optimizer moved below 0: std = rsqrt(self.precision)
        fwd("nan", op("aten.rsqrt.default", st(-9.0, -8.0))),
        ["rsqrt of a negative value", "learned precision", "softplus"],
        ["in bfloat16", "Add an eps inside"],
        id="rsqrt-of-a-negative-learned-precision",
    ),
    pytest.param(
        # float32 features reaching 2e5 cast to a float16 head: no mask anywhere
        fwd(
            "inf",
            op("aten._to_copy.default", st(-3.0, 2.0e5), output=st(INF, 1.0, dtype=F16)),
            dtype="torch.float16",
        ),
        ["cast values reaching 2e+05 to float16", "Keep this part in float32"],
        ["mask"],
        id="cast-overflow-without-a-mask",
    ),
    pytest.param(
        # a KL by hand, p * log(p) - p * log(q), q underflowing: +Inf, no 0 * -inf
        fwd(
            "inf",
            OpInfo(
                "aten.log.default",
                (st(0.0, 0.4),),
                st(-math.inf, -1.0),
                source="m.py:9 in forward: kl = (p * torch.log(p) - p * torch.log(q)).sum(-1)",
            ),
        ),
        [],
        ["entropy"],
        id="kl-by-hand-is-no-entropy",
    ),
    pytest.param(
        fwd(
            "nan",
            OpInfo(
                "aten.log.default",
                (st(0.0, 0.4),),
                st(-math.inf, -1.0),
                source="attn.py:12 in forward: ent = -(p * torch.log(p)).sum(-1).mean()",
            ),
        ),
        ["entropy p * log(p)", "torch.special.entr(p)", "xlogy"],
        ["clamp_min(1e-12)", "use log_softmax"],
        id="entropy-of-a-masked-probability",
    ),
    pytest.param(
        # (1 - attention_mask) * float("-inf"): 0 * -inf where the mask is 1.
        fwd("nan", op("aten.mul.Tensor", st(0.0, 1.0), args=(float("-inf"),))),
        ["infinite value by 0", "masked_fill(mask == 0", "finfo"],
        ["from finite inputs"],
        id="mask-times-minus-inf",
    ),
    pytest.param(
        fwd("nan", op("aten.acos.default", st(0.5, 1.5))),
        ["outside [-1, 1]", "1.5", "-1+eps, 1-eps"],
        [],
        id="acos-out-of-range",
    ),
    pytest.param(
        fwd("inf", op("aten.atanh.default", st(0.5, 1.0))),
        ["at or beyond +-1", "-1+eps, 1-eps"],
        [],
        id="atanh-at-one",
    ),
    pytest.param(
        fwd("nan", op("aten.pow.Tensor_Scalar", st(-2.0, 1.0), args=(0.5,))),
        ["negative base", "fractional power", "base is in [-2, 1]"],
        [],
        id="pow-negative-base",
    ),
    pytest.param(
        fwd("inf", op("aten.pow.Tensor_Scalar", st(0.0, 2.0), args=(-1.0,))),
        ["0 to a negative power", "base is in [0, 2]", "eps"],
        [],
        id="pow-zero-negative",
    ),
    pytest.param(
        fwd("inf", op("aten.div.Tensor", st(1.0, 2.0), st(0.0, 1.0))),
        ["divided by zero", "denominator is in [0, 1]", "eps"],
        [],
        id="div-by-zero",
    ),
    pytest.param(
        fwd("nan", op("aten.div.Tensor", st(0.0), st(0.0))),
        ["divided by zero", "0/0"],
        [],
        id="div-zero-by-zero",
    ),
    pytest.param(
        fwd("inf", op("aten.reciprocal.default", st(0.0, 3.0))),
        ["divided by zero"],
        [],
        id="reciprocal-zero",
    ),
    pytest.param(
        fwd("inf", op("aten.div.Scalar", st(1.0), None, args=(0,))),
        ["divided by the number 0"],
        [],
        id="div-scalar-zero",
    ),
    pytest.param(
        fwd("inf", op("aten.lgamma.default", st(-1.0, 0.0))),
        ["non-positive integer"],
        [],
        id="lgamma-pole",
    ),
    pytest.param(
        fwd("nan", op("aten.mean.default", TensorStats.of(torch.zeros(0)))),
        ["zero elements", "max(count, 1)"],
        [],
        id="mean-of-empty",
    ),
    pytest.param(
        fwd("nan", op("aten.nll_loss_forward.default", st(-1.0, -2.0))),
        ["ignore_index"],
        [],
        id="nll-all-ignored",
    ),
    # --- a variance over a single element --------------------------------------------
    pytest.param(
        fwd("nan", op("aten.var.correction", st(3.0))),
        # (correction=0 alone only moves the NaN into the division by the std: fairseq's
        # per-utterance normalisation of a one-frame utterance)
        ["N-1 = 0", "Skip inputs of one element", "correction=0 and divide by std + eps"],
        [],
        id="var-single",
    ),
    pytest.param(
        fwd("nan", op("aten.std_mean.correction", st(3.0))),
        ["N-1 = 0"],
        [],
        id="std-mean-single",
    ),
    pytest.param(
        fwd("nan", op("aten._native_batch_norm_legit_functional.default", st(1.0, 2.0, 3.0))),
        [UNKNOWN],
        ["N-1"],
        id="batch-norm-1d-input-no-channel-evidence",
    ),
    pytest.param(
        fwd(
            "nan",
            op("aten.native_batch_norm.default", TensorStats.of(torch.ones(1, 3))),
        ),
        ["one value per channel", "N-1 = 0", "drop_last"],
        [],
        id="batch-norm-batch-of-one",
    ),
    pytest.param(
        fwd("nan", op("aten.native_batch_norm.default", TensorStats.of(torch.ones(4, 3)))),
        [UNKNOWN],
        ["N-1"],
        id="batch-norm-real-batch",
    ),
    pytest.param(
        # GCN degree normalisation with an isolated node: pow made +Inf, a later 0 * inf NaN.
        fwd(
            "nan",
            op("aten.pow.Tensor_Scalar", st(0.0, 16.0), output=st(math.inf, 0.25), args=(-0.5,)),
        ),
        ["0 to a negative power", "isolated node", "clamp_min(1)"],
        ["negative base"],
        id="pow-degree-zero",
    ),
    pytest.param(
        fwd(
            "nan",
            OpInfo(
                "aten.log.default",
                (st(-1.0),),
                st(math.nan),
                source="flow.py:12 in forward: return torch.log(torch.det(self.w))",
            ),
        ),
        ["determinant", "slogdet"],
        ["clamp_min"],
        id="log-of-det",
    ),
    pytest.param(
        fwd(
            "inf",
            OpInfo(
                "aten.log.default",
                (st(0.0),),
                st(-math.inf),
                source="glow.py:30 in forward: ld = torch.log(torch.abs(torch.det(self.w)))",
            ),
        ),
        # (or underflowed: det of 0.1 * an orthogonal 64x64 is 1e-64, 0 in float32)
        ["determinant that is 0", "underflowed", "slogdet(A).logabsdet keeps", "singular", "LU"],
        ["negative"],
        id="log-of-det-of-a-singular-matrix",
    ),
    pytest.param(
        fwd("nan", op("aten.native_layer_norm.default", st(-3e30, 1e37))),
        ["variance overflowed", "1e+37", "exploding"],
        ["eps > 0"],
        id="layer-norm-variance-overflow",
    ),
    pytest.param(
        fwd("nan", op("aten._weight_norm_interface.default", st(0.0, 0.5), st(1.0))),
        ["weight normalisation", "all zeros", "0/0"],
        [UNKNOWN],
        id="weight-norm-zero-row",
    ),
    pytest.param(
        fwd("inf", op("aten._weight_norm_interface.default", st(1e-30, 0.5), st(1.0))),
        ["weight normalisation", "underflows", "divides by 0"],
        [UNKNOWN, "all zeros"],
        id="weight-norm-underflowed-row",
    ),
    # --- the backward: a finite forward with an infinite derivative ------------------
    pytest.param(
        # A VAE's Bernoulli decoder: float16 sigmoid outputs of exactly 0, BCE inside the model
        bwd("nan", "BinaryCrossEntropyBackward0", "aten.binary_cross_entropy_backward.default"),
        ["BinaryCrossEntropyBackward0", "p * (1 - p)", "binary_cross_entropy_with_logits"],
        [UNKNOWN],
        id="backward-bce-saturated",
    ),
    pytest.param(
        bwd("inf", "SqrtBackward0", "aten.div.Tensor"),
        ["SqrtBackward0", "sqrt", "at 0", "identical", "eps inside the sqrt"],
        ["divided by zero"],
        id="bwd-sqrt",
    ),
    pytest.param(
        # The step's gradient is NaN, but the sqrt's backward made +Inf (a later op, NaN).
        HintContext(
            phase="backward",
            kind="nan",
            reason="backward",
            op=op("aten.div.Tensor", st(1.0), st(0.0), output=st(math.inf), node="SqrtBackward0"),
        ),
        ["SqrtBackward0 made +Inf"],
        ["made NaN"],
        id="bwd-sqrt-made-inf",
    ),
    pytest.param(
        bwd("nan", "LinalgVectorNormBackward0"),
        ["norm", "zero vector", "identical points", "1e-12"],
        [],
        id="bwd-norm",
    ),
    pytest.param(
        bwd("inf", "AcosBackward0"),
        ["acos", "+-1", "-1+eps, 1-eps"],
        [],
        id="bwd-acos",
    ),
    pytest.param(
        bwd("inf", "PowBackward0"),
        ["0 < p < 1", "(x + eps) ** p"],
        [],
        id="bwd-pow",
    ),
    pytest.param(
        # gcn_norm: deg.pow(-0.5), its Inf masked_fill-ed to 0; the backward's x ** (p - 1)
        HintContext(
            phase="backward",
            kind="inf",
            reason="backward",
            op=op("aten.pow.Tensor_Scalar", st(0.0, 6.0), node="PowBackward0", args=(-1.5,)),
        ),
        ["p = -0.5", "zeroed afterwards (masked_fill)", "x.clamp_min(eps) ** p", "self-loops"],
        ["0 < p < 1"],
        id="bwd-pow-negative-exponent-hidden-inf",
    ),
    pytest.param(
        bwd("inf", "DivBackward0"),
        ["-x / y^2", "denominator"],
        [],
        id="bwd-div",
    ),
    pytest.param(
        bwd("nan", "LogBackward0"),
        ["log", "nan_to_num", "clamp_min"],
        [],
        id="bwd-log",
    ),
    pytest.param(
        bwd("nan", "WhereBackward0"),
        ["torch.where", "unselected branch", "0 * inf"],
        [],
        id="bwd-where",
    ),
    pytest.param(
        # ArcFace under bfloat16 autocast: clamp(-1 + 1e-7, 1 - 1e-7) left the cosine at 1.0,
        # and acos's derivative there is infinite: no overflow, whatever the dtype.
        HintContext(
            phase="backward",
            kind="nan",
            reason="backward",
            op=op(
                "aten.rsqrt.default",
                st(0.0, 0.5, dtype=BF16),
                output=st(INF, 1.0, dtype=BF16),
                node="AcosBackward0",
            ),
        ),
        ["acos", "rounds to 1.0", "float32"],
        ["overflow", "GradScaler", "learning rate"],
        id="bwd-acos-bf16-clamp",
    ),
    pytest.param(
        # A focal loss's (1 - p) ** 0.5 at p = 1 in float16: a derivative infinite at 0, which
        # no loss scale makes (no GradScaler sentence either).
        HintContext(
            phase="backward",
            kind="nan",
            reason="backward",
            op=op(
                "aten.pow.Tensor_Scalar",
                st(0.0, 0.25, dtype=F16),
                output=st(INF, 1.0, dtype=F16),
                node="PowBackward0",
                args=(-0.5,),
            ),
        ),
        ["x ** p", "infinite at x = 0"],
        ["overflow", "GradScaler"],
        id="bwd-pow-fp16-at-zero",
    ),
    pytest.param(
        fwd(
            "nan",
            op("aten.div.Tensor", st(0.0), st(0.0), output=st(NAN)),
            module_type="_SpectralNorm",
        ),
        ["largest singular value", "all zeros", "spectral_norm"],
        ["Add an eps"],
        id="spectral-norm-zero-weight",
    ),
    pytest.param(
        # Manifold mixup's lam * h with lam a Python float from a numpy 0/0.
        fwd("nan", op("aten.mul.Tensor", st(0.5, -1.0), args=(NAN,))),
        ["NaN as a plain number", "mixup lambda"],
        [UNKNOWN, "finite inputs"],
        id="nan-python-scalar",
    ),
    pytest.param(
        # A VAE's exp(logvar) under bfloat16 with one feature of 600 in the batch: outputs of
        # 4e28 from weights of 0.5, squared by the loss.
        HintContext(
            phase="loss",
            kind="inf",
            reason="loss",
            output_peak=4.1e28,
            input_peak=600.0,
            weight_peak=0.49,
            updates=2,
        ),
        ["not exploding", "an exp of a scale", "values up to 600"],
        ["learning rate", "exploding (a"],
        id="huge-outputs-modest-weights",
    ),
    pytest.param(
        # A layer norm without eps given 1000 +- 0.5 in bfloat16: every value rounds to 1000,
        # the variance is exactly 0. An eps would hide that the spread is gone.
        fwd(
            "nan",
            op("aten.rsqrt.default", st(0.0, 0.0, dtype=BF16)),
            call_inputs=(st(1000.0, 1000.0, 1000.0, dtype=BF16),),
        ),
        ["spread of 0", "bfloat16", "float32"],
        ["Add an eps"],
        id="bf16-lost-spread",
    ),
    pytest.param(
        # Left padding under a -inf causal mask: the softmax's NaN rows zeroed by nan_to_num
        # in the forward, read again by its backward.
        HintContext(
            phase="backward",
            kind="nan",
            reason="backward",
            op=op(
                "aten._softmax_backward_data.default",
                st(0.1, -0.2),
                st(NAN, 0.5),
                node="SoftmaxBackward0",
            ),
        ),
        ["every position is masked", "nan_to_num", "finfo"],
        ["safe input"],
        id="bwd-softmax-hidden-masked-row",
    ),
    pytest.param(
        # A schedule's coefficient, 0/0, broadcast with h.new_full((B, 1), lam).
        fwd("nan", op("aten.new_full.default", st(0.5, -1.0), args=(NAN,))),
        ["NaN as a plain number"],
        [UNKNOWN],
        id="nan-number-into-new-full",
    ),
    pytest.param(
        # A NaN the forward hid behind masked_fill, read again by its backward: the function
        # is named as it is spelled, not as its autograd node's lower-cased base.
        HintContext(
            phase="backward",
            kind="nan",
            reason="backward",
            op=op("aten.mul.Tensor", st(1.0), st(NAN, 0.5), node="MaskedFillBackward0"),
        ),
        ["masked_fill of an invalid input"],
        ["maskedfill"],
        id="bwd-hidden-nan-names-the-function",
    ),
    pytest.param(
        # F.pad(value=nan): NaN padding written on purpose, no scalar computed by accident.
        fwd("nan", op("aten.constant_pad_nd.default", st(0.5, -1.0), args=(NAN,))),
        [],
        ["plain number", "mixup"],
        id="nan-padding-is-no-nan-number",
    ),
    pytest.param(
        # An LM's cross_entropy (on logits) of a bfloat16 model over a micro-batch whose
        # labels are all -100: 0/0, no probability rounding to 0 involved.
        HintContext(
            phase="loss",
            kind="nan",
            reason="loss",
            output_dtype="torch.bfloat16",
            loss_ops=("NllLossBackward0", "LogSoftmaxBackward0"),
        ),
        ["ignore_index"],
        ["round to exactly"],
        id="bf16-all-ignored-labels",
    ),
    pytest.param(
        # A KV-cache offset of 66000 cast to a float16 model's rotary frequencies' dtype.
        fwd(
            "inf",
            op(
                "aten._to_copy.default",
                TensorStats.of(torch.arange(66000, 66008)),
                output=st(INF, 65000.0, dtype=F16),
            ),
        ),
        ["cast integers reaching 66007", "float16", "float32"],
        ["scale its activations", UNKNOWN],
        id="int-positions-cast-to-fp16",
    ),
    pytest.param(
        # (Weight-norm's backward is no eigendecomposition, whatever its name holds)
        bwd("inf", "WeightNormInterfaceBackward0"),
        ["weight normalisation", "tiny norm", "eps"],
        ["SVD", "eigendecomposition"],
        id="bwd-weight-norm",
    ),
    pytest.param(
        bwd("nan", "LinalgSvdBackward0"),
        ["SVD", "repeated values"],
        [],
        id="bwd-svd",
    ),
    pytest.param(
        bwd("nan", "LinalgEighBackward0"),
        ["eigendecomposition", "repeated values"],
        [],
        id="bwd-eigh",
    ),
    pytest.param(
        bwd("nan", "LogsumexpBackward0"),
        ["logsumexp", "-inf"],
        [],
        id="bwd-logsumexp",
    ),
    pytest.param(
        bwd("nan", "NativeBatchNormBackward0"),
        [UNKNOWN, "NativeBatchNormBackward0", "aten.mul.Tensor", "backward"],
        ["zero vector"],
        id="bwd-batch-norm-is-not-a-distance",
    ),
    pytest.param(
        HintContext(
            phase="backward",
            kind="inf",
            reason="backward",
            op=OpInfo("aten.div.Tensor", (st(1.0), st(0.0)), None, direction="backward"),
        ),
        [UNKNOWN, "aten.div.Tensor made Inf in the backward"],
        ["divided by zero"],
        id="bwd-op-without-node",
    ),
    # --- circumstantial evidence -----------------------------------------------------
    pytest.param(
        fwd("nan", grad_norm_alarm_step=45, step=50),
        ["gradient norm spiked at step 45", "5 steps earlier", "learning rate", "clip"],
        [],
        id="grad-norm-spike",
    ),
    pytest.param(  # (an update follows the step's spike: it can be the cause)
        HintContext(phase="param", kind="nan", reason="param", grad_norm_alarm_step=50, step=50),
        ["at this step", "learning rate"],
        [],
        id="grad-norm-spike-same-step",
    ),
    pytest.param(  # (a forward comes before its own step's gradients: the same batch made both)
        fwd("nan", grad_norm_alarm_step=50, step=50),
        [],
        ["spiked", "Lower the learning rate"],
        id="grad-norm-spike-same-step-forward",
    ),
    pytest.param(
        fwd("nan", grad_norm_alarm_step=0, step=100),
        [UNKNOWN],
        ["spiked"],
        id="grad-norm-spike-too-old",
    ),
    pytest.param(
        fwd("nan", grad_norm_alarm_step=60, step=50),
        [UNKNOWN],
        ["spiked"],
        id="grad-norm-spike-after-origin",
    ),
    pytest.param(
        HintContext(phase="grad", kind="inf", reason="grad", amp_collapsed=True),
        ["GradScaler", "collapsed", "bfloat16", "float32"],
        [],
        id="amp-collapsed",
    ),
    # --- parameters and the loss -----------------------------------------------------
    pytest.param(
        HintContext(
            phase="param", kind="nan", reason="param", stats=st(NAN, dtype=F16), optimizer="AdamW"
        ),
        ["AdamW", "float16", "eps=1e-8", "second moment", "+-Inf", "float32 master weights"],
        [],
        id="param-adam-fp16",
    ),
    pytest.param(
        HintContext(phase="param", kind="inf", reason="param", stats=st(INF), optimizer="Adam"),
        ["Adam.step()", "learning rate"],
        ["eps=1e-8"],
        id="param-adam-fp32",
    ),
    pytest.param(
        HintContext(phase="param", kind="nan", reason="param", stats=st(NAN), optimizer="AdamW"),
        ["AdamW.step()", "0/0", "eps=0", "Set eps > 0"],
        ["Inf/Inf"],
        id="param-adam-nan-zero-gradient",
    ),
    pytest.param(
        HintContext(phase="param", kind="nan", reason="param", stats=st(NAN), optimizer="Adagrad"),
        ["Adagrad.step()", "sum of grad**2", "the default 1e-10"],
        ["m / (sqrt(v)", "1e-8"],
        id="param-adagrad-nan-zero-gradient",
    ),
    pytest.param(  # (Adan divides by sqrt(v) + eps too)
        HintContext(phase="param", kind="nan", reason="param", optimizer="Adan"),
        ["eps", "0/0"],
        ["Lower the learning rate"],
        id="param-adan-nan-zero-gradient",
    ),
    pytest.param(  # a plain SGD step cannot make NaN next to weights this small
        HintContext(
            phase="param", kind="nan", reason="param", optimizer="SGD", stats=st(NAN, 0.5, -0.6)
        ),
        ["cannot make NaN", "writes the weights after the step"],
        ["Lower the learning rate"],
        id="param-sgd-nan-small-weights",
    ),
    pytest.param(  # ...nor +Inf, at a sane learning rate (a weight set to inf by hand)
        HintContext(
            phase="param", kind="inf", reason="param", optimizer="SGD", stats=st(INF, 0.5, -0.6)
        ),
        ["cannot make +Inf", "writes the weights after the step"],
        ["Lower the learning rate"],
        id="param-sgd-inf-small-weights",
    ),
    pytest.param(  # (a learning rate out of proportion can overflow the update to Inf)
        HintContext(
            phase="param",
            kind="inf",
            reason="param",
            optimizer="SGD",
            stats=st(INF, 0.5, -0.6),
            learning_rate="The learning rate 1e+40 of parameter group 0 is far too large.",
        ),
        [],
        ["cannot make"],
        id="param-sgd-inf-huge-learning-rate",
    ),
    pytest.param(  # a fixed temperature, not an annealed one
        fwd(
            "nan",
            op(
                "aten.div.Tensor",
                st(-2.5e4, 6.0e4, dtype=F16),
                output=st(INF, 1.0, dtype=F16),
                args=(0.5,),
            ),
        ),
        ["divided by 0.5", "overflowed to Inf", "float32"],
        ["tau >= 0.1"],
        id="div-by-fixed-temperature-overflow",
    ),
    pytest.param(
        fwd(
            "nan",
            op("aten.div.Tensor", st(-3.0, 5.0), output=st(INF, 1.0), args=(1e-38,)),
        ),
        ["divided by 1e-38", "gumbel_softmax's tau", "tau >= 0.1"],
        [UNKNOWN],
        id="div-by-annealed-temperature",
    ),
    pytest.param(
        # GAT by hand: the max over a node's empty segment is -inf, exp(e - max) is +Inf, and
        # the normaliser Inf / Inf.
        fwd("nan", op("aten.div.Tensor", st(INF, 2.0), st(INF, 3.0))),
        ["divided Inf by Inf", "an eps does not help", "empty set"],
        ["divided by zero"],
        id="div-inf-by-inf",
    ),
    pytest.param(
        HintContext(phase="param", kind="nan", reason="buffer_before_training", stats=st(NAN)),
        ["buffer was NaN before any optimizer step", "__init__", "an eps or a clamp"],
        [UNKNOWN],
        id="buffer-before-training",
    ),
    pytest.param(
        # improved-DDPM's KL with an unclipped posterior log-variance: exp(-log(0)) = +Inf,
        # hidden by torch.where(t == 0, nll, kl); no exponent overflowed.
        HintContext(
            phase="backward",
            kind="nan",
            reason="backward",
            op=op("aten.mul.Tensor", st(0.0, 1.0), st(INF, 2.0), node="ExpBackward0"),
        ),
        ["its saved result, +Inf", "its input was +Inf already", "torch.where"],
        [UNKNOWN],
        id="hidden-exp-of-inf",
    ),
    # --- a loss's own operations, by autograd node -------------------------------------
    pytest.param(
        HintContext(
            phase="loss",
            kind="nan",
            reason="loss",
            loss_ops=("MeanBackward0", "LogBackward0", "AcosBackward0", "DivBackward0"),
        ),
        ["one of its own operations: acos/asin: NaN past +-1", "log: NaN below 0"],
        ["a division", UNKNOWN],  # (two at most, the likeliest first)
        id="loss-ops-nan",
    ),
    pytest.param(
        HintContext(
            phase="loss",
            kind="inf",
            reason="loss",
            loss_ops=("SumBackward0", "ExpBackward0", "DivBackward0", "AcosBackward0"),
        ),
        ["division by zero (MAPE", "logvar.exp()", "Inf in the targets"],
        ["acos"],
        id="loss-ops-inf",
    ),
    pytest.param(
        HintContext(
            phase="loss",
            kind="nan",
            reason="loss_backward",
            loss_ops=("MeanBackward0", "SqrtBackward0", "PowBackward0:integer", "SumBackward1"),
        ),
        ["backward made NaN from a finite loss", "sqrt, whose slope is Inf at 0"],
        ["x ** p"],  # (a square has no infinite slope)
        id="loss-backward-sqrt",
    ),
    pytest.param(
        HintContext(
            phase="loss",
            kind="nan",
            reason="loss_backward",
            loss_ops=("MeanBackward0", "MulBackward0", "PowBackward0", "NllLossBackward0"),
        ),
        ["x ** p, whose slope is Inf at 0 for p < 1", "focal"],
        [],
        id="loss-backward-fractional-power",
    ),
    pytest.param(
        HintContext(phase="loss", kind="nan", reason="loss", loss_ops=("MseLossBackward0",)),
        ["NaN in the targets", "0 * log(0)"],
        ["one of its own operations"],
        id="loss-ops-none-telling",
    ),
    pytest.param(
        HintContext(phase="param", kind="nan", reason="param", stats=st(NAN), optimizer="RMSprop"),
        ["RMSprop.step()", "grad / (sqrt(v) + eps)", "the default 1e-8"],
        ["m / (sqrt(v)"],
        id="param-rmsprop-nan-zero-gradient",
    ),
    pytest.param(
        HintContext(
            phase="param", kind="nan", reason="param", stats=st(NAN), optimizer="Adafactor"
        ),
        ["Adafactor.step()", "factored v", "(1e-30, 1e-3)"],
        ["m / (sqrt(v)", "1e-8"],
        id="param-adafactor-nan-zero-gradient",
    ),
    pytest.param(
        # A hand-written LAMB on LoRA adapters: B starts at 0, so A's gradient and update are
        # 0, and the trust ratio ||w|| / ||u|| is inf, times 0.
        HintContext(phase="param", kind="nan", reason="param", stats=st(NAN), optimizer="Lamb"),
        ["Lamb.step()", "trust ratio", "LoRA", "a trust ratio of 1 where either norm is 0"],
        ["Set eps > 0"],
        id="param-lamb-trust-ratio",
    ),
    pytest.param(
        # (eps > 0 does not take the trust ratio's inf * 0 away)
        HintContext(
            phase="param",
            kind="nan",
            reason="param",
            stats=st(NAN),
            optimizer="Lamb",
            optimizer_eps=1e-6,
        ),
        ["Lamb.step()", "trust ratio"],
        ["written outside optimizer.step()"],
        id="param-lamb-trust-ratio-with-eps",
    ),
    pytest.param(
        HintContext(
            phase="param",
            kind="nan",
            reason="param",
            stats=st(NAN),
            optimizer="Adam",
            optimizer_eps=1e-8,
        ),
        ["eps=1e-08, so no 0/0", "written outside optimizer.step()"],
        ["Set eps > 0"],
        id="param-adam-eps-not-zero",
    ),
    pytest.param(
        # Llama under AdamW at lr=1e2: a gradient of 2e38 a step after the norm spiked
        HintContext(
            phase="param",
            kind="nan",
            reason="param",
            stats=st(NAN),
            optimizer="AdamW",
            step=3,
            grad_norm_alarm_step=2,
        ),
        ["AdamW.step()", "finite but huge", "spiked at step 2", "Inf/Inf", "Lower the learning"],
        ["eps=0", "Set eps"],
        id="param-adam-nan-huge-gradients",
    ),
    pytest.param(
        HintContext(
            phase="param", kind="inf", reason="param", stats=st(INF, dtype=F16), optimizer="SGD"
        ),
        ["SGD.step()", "learning rate"],
        ["eps=1e-8"],
        id="param-sgd-fp16",
    ),
    pytest.param(
        HintContext(phase="loss", kind="inf", reason="loss", stats=st(INF)),
        [
            "loss is +Inf",
            "division by zero",
            "MAPE",
            "log(0)",
            "exp overflow",
            "logvar.exp()",
            "log_softmax",
            "CTC",
            "zero_infinity=True",
        ],
        [],
        id="loss-inf",
    ),
    pytest.param(
        HintContext(phase="loss", kind="inf", reason="loss", stats=st(INF), output_peak=2.5e21),
        ["outputs were huge", "2.5e+21", "exploding", "learning rate"],
        ["log(0)"],
        id="loss-inf-huge-outputs",
    ),
    pytest.param(
        HintContext(phase="loss", kind="nan", reason="loss", stats=st(NAN)),
        ["NaN from finite model outputs", "NaN in the targets", "a mean over nothing (0/0)"],
        [UNKNOWN],
        id="loss-nan",
    ),
    pytest.param(
        HintContext(phase="loss", kind="nan", reason="loss_backward", stats=st(NAN)),
        ["loss's backward", "zero distance", "acos at +-1", "focal loss", "kl_div", "add an eps"],
        [],
        id="loss-backward",
    ),
    pytest.param(
        # nanoGPT's manual attention in float16: (q @ k.transpose(-2, -1)) * scale overflows.
        fwd(
            "inf",
            op(
                "aten.bmm.default",
                st(300.0, dtype=F16),
                st(250.0, dtype=F16),
                output=st(INF, 1.0, dtype=F16),
            ),
            dtype="torch.float16",
        ),
        ["overflowed float16", "1/sqrt(head_dim) before q @ k.T", "scaled_dot_product_attention"],
        [],
        id="float16-attention-scores-overflow",
    ),
    pytest.param(
        # PPO: exp(logp - old_logp) overflowed, the clipped objective hid it, 0 * inf.
        HintContext(phase="loss", kind="nan", reason="loss_backward", stats=st(NAN)),
        ["min/max/clamp/where hid", "times 0", "PPO's ratio", "clamp the log-ratio"],
        [],
        id="loss-backward-hidden-inf",
    ),
    pytest.param(
        HintContext(phase="loss", kind="nan", reason="loss", stats=st(NAN)),
        ["0 * log(0) in an entropy", "torch.special.xlogy"],
        ["float16"],
        id="loss-hand-written-entropy",
    ),
    pytest.param(
        HintContext(phase="loss", kind="nan", reason="loss", stats=st(NAN), dtype="torch.float16"),
        ["The loss is float16 and NaN", "overflow past 65504", "logits.float()"],
        [],
        id="loss-in-float16",
    ),
    pytest.param(
        # A spike shortly before a loss origin: the loss's own causes first, the spike after.
        HintContext(
            phase="loss", kind="nan", reason="loss", stats=st(NAN), grad_norm_alarm_step=10, step=11
        ),
        ["a mean over nothing", "also spiked at step 10, 1 step earlier"],
        [],
        id="loss-after-spike",
    ),
    # --- no evidence: no guess -------------------------------------------------------
    pytest.param(
        fwd("inf", module_type="GaussianHead", stats=st(-INF, 1.0)),
        [UNKNOWN, "-Inf", "GaussianHead", "no operation was named"],
        [],
        id="no-evidence",
    ),
    pytest.param(
        fwd("inf", op("aten.gelu.default", st(3.0, dtype=F16))),
        [UNKNOWN, "aten.gelu.default"],
        ["65504"],
        id="fp16-small-input-no-overflow-evidence",
    ),
]


@pytest.mark.parametrize(("ctx", "present", "absent"), CASES)
def test_rule(ctx: HintContext, present: list[str], absent: list[str]) -> None:
    text = hint(ctx)
    for word in present:
        assert word in text, f"{word!r} not in {text!r}"
    for word in absent:
        assert word not in text, f"{word!r} in {text!r}"


@pytest.mark.parametrize(("ctx", "present", "absent"), CASES)
def test_hint_is_short_and_complete(
    ctx: HintContext, present: list[str], absent: list[str]
) -> None:
    text = hint(ctx)
    assert text.strip() == text
    assert 40 <= len(text) <= MAX_LEN, (len(text), text)
    assert text[0].isupper() or text.startswith(("aten.", "nanguard")), text
    assert text.endswith(".")


def test_unknown_op_is_named_plainly() -> None:
    ctx = fwd("nan", op("aten.foo.default", st(1.0)))
    assert hint(ctx) == (
        "nanguard does not recognise this pattern: aten.foo.default made NaN from finite inputs."
    )


def test_unknown_backward_names_op_and_node() -> None:
    text = hint(bwd("nan", "FooBackward0", "aten.bar.default"))
    assert text == (
        "nanguard does not recognise this pattern: aten.bar.default (FooBackward0) made NaN "
        "in the backward from finite gradients."
    )


# --- priority --------------------------------------------------------------------------

EVERYTHING = {
    "grad_norm_alarm_step": 9,
    "step": 10,
    "amp_collapsed": True,
    "params_nonfinite": True,
    "mask_inputs": True,
}


def test_input_wins_over_everything() -> None:
    o = op("aten.log.default", st(0.0, 1.0))
    ctx = HintContext(phase="input", kind="nan", reason="input", op=o, **EVERYTHING)  # type: ignore[arg-type]
    text = hint(ctx)
    assert "data pipeline" in text
    assert "log of a value" not in text
    assert "GradScaler" not in text


def test_corrupt_weights_win_over_op_and_history() -> None:
    o = op("aten.mm.default", st(30000.0, dtype=F16), st(2.0, dtype=F16))
    text = hint(fwd("inf", o, **EVERYTHING))
    assert "weights were already non-finite" in text
    assert "65504" not in text


def test_fp16_overflow_beats_grad_norm_spike_and_amp() -> None:
    o = op("aten.mm.default", st(300.0, dtype=F16), st(250.0, dtype=F16))
    text = hint(fwd("inf", o, grad_norm_alarm_step=8, step=10, amp_collapsed=True))
    assert "65504" in text
    assert "spiked" not in text
    assert "GradScaler" not in text


def test_op_beats_mask_inputs() -> None:
    # A mask came in, but the replay pinned a log: the log is the cause.
    text = hint(fwd("nan", op("aten.log.default", st(-1.0, 2.0)), mask_inputs=True))
    assert "log of" in text
    assert "fully masked" not in text


def test_domain_beats_fp16_overflow() -> None:
    # log of 0 in float16 is not an overflow, even with a large value next to the 0.
    o = op("aten.log.default", st(0.0, 30000.0, dtype=F16))
    text = hint(fwd("inf", o))
    assert "log of" in text
    assert "65504" not in text


def test_amp_collapse_beats_grad_norm_spike() -> None:
    text = hint(fwd("nan", amp_collapsed=True, grad_norm_alarm_step=9, step=10))
    assert "GradScaler" in text
    assert "spiked" not in text


def test_spike_beats_generic_param_and_loss() -> None:
    ctx = HintContext(phase="loss", kind="inf", reason="loss", grad_norm_alarm_step=3, step=5)
    assert "spiked at step 3" in hint(ctx)
    ctx = dataclasses.replace(ctx, phase="param", reason="param", optimizer="SGD")
    assert "spiked at step 3" in hint(ctx)


def test_adam_fp16_beats_spike() -> None:
    ctx = HintContext(
        phase="param",
        kind="nan",
        reason="param",
        dtype="torch.float16",
        optimizer="Adam",
        grad_norm_alarm_step=3,
        step=5,
    )
    assert "eps=1e-8" in hint(ctx)


def test_known_backward_node_beats_loss_backward_reason() -> None:
    o = op("aten.div.Tensor", st(1.0), st(0.0), node="SqrtBackward0")
    ctx = HintContext(phase="loss", kind="inf", reason="loss_backward", op=o)
    assert "In the backward, SqrtBackward0" in hint(ctx)


def test_hint_never_empty_or_long() -> None:
    ops = [
        None,
        op("aten.log.default"),
        op("aten.foo.default", None, output=None),
        op("aten._scaled_dot_product_flash_attention_for_cpu.default", st(1.0)),
        op("aten.div.Tensor", st(1.0, dtype=F16), st(2.0, dtype=F16)),
        op("aten.pow.Tensor_Tensor", st(0.0), st(-1.0)),
        op("aten.mm.default", st(1.0, dtype=BF16)),
        op("aten.mul.Tensor", st(0.0), node="LinalgVectorNormBackward0"),
        op("aten.mul.Tensor", st(0.0), node="UnknownBackward3"),
    ]
    phases = ["input", "forward", "loss", "backward", "grad", "param"]
    reasons = ["output", "loss", "loss_backward", "param", "grad", "own_code_backward"]
    flags = [
        {},
        {"mask_inputs": True},
        {"stats": st(INF, 1.0, dtype=F16)},
        {"output_dtype": "torch.bfloat16"},
    ]
    for o, phase, reason, kind, extra in itertools.product(
        ops, phases, reasons, ["nan", "inf"], flags
    ):
        ctx = HintContext(phase=phase, kind=kind, reason=reason, op=o, **extra)  # type: ignore[arg-type]
        text = hint(ctx)
        assert isinstance(text, str)
        assert text.strip()
        assert len(text) <= MAX_LEN, (len(text), text)


def test_records_are_frozen() -> None:
    ctx = HintContext(phase="forward", kind="nan", reason="output")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.kind = "inf"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        op("aten.log.default").name = "x"  # type: ignore[misc]


def test_a_nan_target_gets_the_targets_hint() -> None:
    """A regression batch with a missing value in y: finite outputs, NaN loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(3):
            x, y = torch.randn(32, 6), torch.randn(32, 1)
            if step == 2:
                y[7] = float("nan")
            loss = guard.check_loss(nn.functional.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.step, origin.kind) == ("loss", 2, "nan")
    assert origin.hint is not None
    assert "NaN in the targets" in origin.hint


def test_a_learning_rate_far_too_high_is_recognised_from_the_huge_outputs() -> None:
    """SGD with lr=1e18: the first update multiplies the weights by ~1e18; the next step's
    outputs are finite but huge and the MSE overflows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e18)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(2):
            out = model(torch.randn(32, 16) * 10)
            loss = guard.check_loss(nn.functional.mse_loss(out, torch.randn(32, 1) * 1e3))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.step, origin.kind) == ("loss", 1, "inf")
    assert origin.hint is not None
    assert "weights are exploding" in origin.hint


@pytest.mark.parametrize("norm", [nn.LayerNorm(8, eps=0.0), nn.GroupNorm(2, 8, eps=0.0)])
def test_a_normalisation_without_eps_on_a_constant_row_gets_the_eps_hint(norm: nn.Module) -> None:
    """A BERT-style config with layer_norm_eps=0 and an all-zero (padding) sample."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), norm, nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias.zero_()
    x = torch.randn(4, 4)
    x[2] = 0.0
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(x).sum()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "1")
    assert origin.hint is not None
    assert "eps = 0" in origin.hint
    assert "Set eps > 0" in origin.hint


def test_huge_outputs_from_a_huge_input_batch_point_at_the_data() -> None:
    # A missing feature stored as FLT_MAX: the weights are fine, the batch is not.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    x = torch.randn(512, 64)
    x[0, 0] = 3e38
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(x).pow(2).mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "input batch" in origin.hint
    assert "weights are exploding" not in origin.hint


class HalfMLP(nn.Module):
    """GPT-2's MLP run under float16 autocast."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return self.c_proj(nn.functional.gelu(self.c_fc(x))).float()


class HalfBlocks(nn.Module):
    def __init__(self, d: int = 64, vocab: int = 100) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))
        self.mlp = nn.ModuleList(HalfMLP(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for ln, mlp in zip(self.ln, self.mlp, strict=True):
            x = x + mlp(ln(x))
        return self.head(x)


def half_blocks_origin(lrs: tuple[float, float], grow: float = 1.0) -> nanguard.Event:
    torch.manual_seed(0)
    model = HalfBlocks()
    with torch.no_grad():
        model.mlp[1].c_fc.weight.mul_(grow)
    second = {id(p) for p in model.mlp[1].parameters()}
    groups = [
        {"params": [p for p in model.parameters() if id(p) not in second], "lr": lrs[0]},
        {"params": list(model.mlp[1].parameters()), "lr": lrs[1]},
    ]
    opt = torch.optim.AdamW(groups)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(3):
            idx = torch.randint(0, 100, (4, 32))
            logits = model(idx)
            loss = guard.check_loss(
                nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            if guard.origin is not None:
                break
    origin = guard.origin
    assert origin is not None
    return origin


def test_a_learning_rate_typo_for_one_group_is_named_before_the_float16_overflow() -> None:
    # 1e2 for 1e-2: one AdamW step moves every weight of the block by ~100, and the next
    # forward overflows float16 in its up-projection. "Use bfloat16" alone would hide it.
    origin = half_blocks_origin((1e-3, 1e2))
    assert (origin.phase, origin.module, origin.step) == ("forward", "mlp.1.c_proj", 1)
    assert origin.hint is not None
    assert origin.hint.startswith(
        "The learning rate of this module's parameter group is 100, 100,000 times the other "
        "groups' (at most 0.001): a typo?"
    )
    assert "overflowed float16" in origin.hint


def test_the_float16_overflow_of_weights_too_large_at_a_usual_learning_rate_has_no_such_note() -> (
    None
):
    origin = half_blocks_origin((1e-3, 1e-3), grow=2e5)
    assert (origin.phase, origin.module, origin.step) == ("forward", "mlp.1.c_fc", 0)
    assert origin.hint is not None
    assert origin.hint.startswith("aten.addmm.default, with operands reaching")
    assert "learning rate" not in origin.hint


class GaussianVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 128), nn.ReLU())
        self.mu, self.logvar = nn.Linear(128, 16), nn.Linear(128, 16)
        self.dec = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return self.dec(z), mu, logvar


def test_adam_at_lr_1_is_named_when_the_reparameterisation_overflows() -> None:
    torch.manual_seed(0)
    model = GaussianVAE()
    opt = torch.optim.Adam(model.parameters(), lr=1.0)  # for 1e-3
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(10):
            x = torch.randn(32, 64)
            rec, mu, logvar = model(x)
            kld = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
            loss = guard.check_loss(nn.functional.mse_loss(rec, x) + kld)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if guard.origin is not None:
                break
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "", "aten.exp.default")
    assert origin.hint is not None
    assert origin.hint.startswith("Adam with lr=1 moves every weight")
    assert "exp(x) is Inf above x = 88.72" in origin.hint


def test_learning_rate_notes() -> None:
    assert learning_rate_note("SGD", 0.5, []) is None  # (SGD's step is lr x gradient)
    assert learning_rate_note("Adadelta", 1.0, []) is None  # (its default: a scale)
    assert learning_rate_note("Adam", 1e-3, [1e-3, 1e-4]) is None
    assert learning_rate_note("AdamW", 1e-3, [1e-5]) is None  # a fine-tuned head's
    assert learning_rate_note("AdamW", 1e-2, [1e-6]) is not None
    # One Adam step at 0.01 moves a weight by 0.01 at most: not what broke a checkpoint's
    # weights (a head saturating log(sigmoid) from its first step); fifty can have.
    assert learning_rate_note("AdamW", 1e-2, [1e-6], updates=1) is None
    assert learning_rate_note("AdamW", 1e-2, [1e-6], updates=50) is not None
    assert learning_rate_note("SGD", 10.0, [0.01], updates=1) is not None  # (lr x gradient)
    assert learning_rate_note("SGD", 0.1, [], updates=0) is None  # (no update yet)
    nan = learning_rate_note("AdamW", float("nan"), [], updates=0)
    assert nan is not None
    assert "is nan: a scheduler made it" in nan
    sgd = learning_rate_note("SGD", 10.0, [0.01])
    assert sgd is not None
    assert sgd.endswith("lr x gradient.")
    # A group's rate zeroed by a scheduler to 1e-30 beside a typo's 1e5: a ratio in a few
    # characters, not 36 digits.
    huge = learning_rate_note("Adam", 1e5, [1e-30])
    assert huge is not None
    assert "is 100000, 1e+35 times the other groups' (at most 1e-30)" in huge
    assert "100,000 times" in (learning_rate_note("AdamW", 100.0, [1e-3]) or "")


def forward_origin(model: nn.Module, *args: torch.Tensor) -> nanguard.Event:
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(*args).float().sum()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.hint is not None
    return origin


class PoincareArtanh(nn.Module):
    """HGCN's artanh: its clamp to 1 - 1e-15 is a no-op in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clamp(-1 + 1e-15, 1 - 1e-15)
        return 0.5 * (torch.log1p(x) - torch.log1p(-x))


def test_log1p_at_minus_one_is_told_to_stay_above_minus_one() -> None:
    model = nn.Sequential(nn.Linear(2, 2), PoincareArtanh())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
        model[0].bias.zero_()
    origin = forward_origin(model, torch.tanh(torch.tensor([[0.5, -12.0]])))
    assert (origin.module, origin.op) == ("1", "aten.log1p.default")
    assert "x.clamp_min(-1 + 1e-6)" in origin.hint
    assert "1e-12" not in origin.hint  # (clamp_min(1e-12) would clip every negative input)


class Dequantize(nn.Module):
    """RealNVP's preprocessing: logit of dequantised pixels, of which white ones pass 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logit(x + torch.rand_like(x) / 256)


def test_logit_outside_zero_one_is_recognised() -> None:
    torch.manual_seed(0)
    pixels = torch.rand(4, 3, 8, 8)
    pixels[1, :, :2] = 1.0  # white pixels
    origin = forward_origin(nn.Sequential(Dequantize(), nn.Flatten(), nn.Linear(192, 1)), pixels)
    assert (origin.module, origin.op) == ("0", "aten.logit.default")
    assert origin.hint.startswith("aten.logit.default got a value outside (0, 1)")
    assert "alpha + (1 - 2 * alpha) * x" in origin.hint


class ConstrainedCRFScore(nn.Module):
    """A CRF's gold-path score with forbidden transitions masked with -inf (BIO tagging)."""

    def __init__(self, tags: int = 5) -> None:
        super().__init__()
        self.trans = nn.Parameter(torch.randn(tags, tags) * 0.1)
        allowed = torch.ones(tags, tags, dtype=torch.bool)
        allowed[0, 2] = False  # O -> I-PER is forbidden
        self.register_buffer("allowed", allowed)

    def forward(
        self, emissions: torch.Tensor, prev: torch.Tensor, tag: torch.Tensor
    ) -> torch.Tensor:
        t = self.trans.masked_fill(~self.allowed, float("-inf"))
        logz = torch.logsumexp(emissions.unsqueeze(1) + t, dim=-1).logsumexp(-1)
        gold = emissions.gather(1, tag[:, None]).squeeze(1) + t[prev, tag]
        return logz - gold  # the NLL: +Inf for a gold path through a forbidden transition


def test_an_output_reading_a_masked_entry_points_at_the_targets() -> None:
    torch.manual_seed(0)
    prev, tag = torch.tensor([0, 1, 0]), torch.tensor([0, 1, 2])  # an annotation error: O -> I
    origin = forward_origin(ConstrainedCRFScore(), torch.randn(3, 5), prev, tag)
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "inf")
    assert origin.op == "aten.masked_fill.Scalar"
    assert origin.hint.startswith("aten.masked_fill.Scalar wrote -inf on purpose (a mask)")
    assert "Check the targets against the mask" in origin.hint


class HalfProjector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.net(x), dim=1)


def test_an_exp_overflowing_float16_in_a_loss_promoted_to_float32_is_named() -> None:
    # Lightning Bolts' nt_xent_loss on a .half() model: exp(cos / 0.07) passes 65504 in
    # float16; a float32 constant in the loss makes the loss itself float32.
    torch.manual_seed(0)
    model = HalfProjector().half()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        out = model(torch.randn(16, 32).half())
        out = torch.cat([out, out + 0.01 * torch.randn_like(out)])
        sim = torch.exp(out @ out.t() / 0.07)  # float16
        neg = sim.sum(dim=-1) - torch.full((32,), math.e ** (1 / 0.07))  # a float32 constant
        pos = torch.exp((out[:16] * out[16:]).sum(-1) / 0.07).repeat(2)
        loss = guard.check_loss(-torch.log(pos / neg).mean())
        assert loss.dtype == torch.float32
        loss.backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "an exp or a product computed in float16" in origin.hint


def test_a_spike_episode_is_named_from_its_first_spike() -> None:
    op = OpInfo(name="aten.addmm.default", inputs=(None,), output=None)
    ctx = HintContext(
        phase="forward", kind="inf", reason="output", op=op, dtype="torch.float32", step=65,
        grad_norm_alarm_step=64, grad_norm_alarm_first=61,
    )  # fmt: skip
    assert "spike at step 61, 4 steps earlier (and again up to step 64)" in hint(ctx)
    single = dataclasses.replace(ctx, grad_norm_alarm_first=64)
    assert "spike at step 64, 1 step earlier" in hint(single)


def test_a_learning_rate_far_too_high_comes_first_for_a_weight_an_adam_step_made_nan() -> None:
    note = learning_rate_note("AdamW", 97.96, [])
    assert note is not None
    text = hint(
        HintContext(
            phase="param",
            kind="nan",
            reason="param",
            stats=st(NAN),
            optimizer="AdamW",
            learning_rate=note,
        )
    )
    assert text.startswith("AdamW with lr=97.96 moves every weight")
    assert "What the optimizer did: NaN in AdamW.step() from gradients that were finite" in text


class MultiTaskLossWrapper(nn.Module):
    """Kendall et al.'s learned uncertainty weights, as a wrapper around the backbone: its
    own log-variances in a group of their own, at a far larger learning rate."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
        self.log_vars = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor, aux_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        loss0 = nn.functional.mse_loss(out[:, 0], y)
        # No auxiliary labels in these batches: this task's loss is 0, its log-variance falls.
        loss1 = ((out[:, 1] - y) ** 2 * aux_mask).sum() / aux_mask.sum().clamp(min=1)
        return (
            torch.exp(-self.log_vars[0]) * loss0
            + self.log_vars[0]
            + torch.exp(-self.log_vars[1]) * loss1
            + self.log_vars[1]
        )


@pytest.mark.parametrize("backbone_first", [True, False])
def test_the_learning_rate_note_is_the_origin_modules_own_parameters_group(
    backbone_first: bool,
) -> None:
    torch.manual_seed(0)
    net = MultiTaskLossWrapper()
    groups = [{"params": net.model.parameters(), "lr": 1e-4}, {"params": [net.log_vars], "lr": 1.0}]
    opt = torch.optim.Adam(groups if backbone_first else groups[::-1])
    with nanguard.watch(net, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(120):
            x = torch.randn(32, 16)
            loss = guard.check_loss(net(x, x[:, 0], torch.zeros(32)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if guard.origin is not None:
                break
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "", "aten.exp.default")
    assert origin.hint is not None
    assert origin.hint.startswith(
        "The learning rate of this module's parameter group is 1, 10,000 times the other groups'"
    )


def test_a_deliberate_learning_rate_ratio_comes_after_a_log_of_zero() -> None:
    # Discriminative fine-tuning (a head at 1000x the backbone's rate): an outlier batch's
    # softmax underflows and the head's log(softmax) is -Inf. The log is the cause to fix;
    # the rate is said after it. An overflow (exp) keeps the rate first.
    note = learning_rate_note("AdamW", 1e-2, [1e-5], updates=20)
    assert note is not None
    log_zero = op("aten.log.default", st(0.0, 0.5, 1.0), output=st(-math.inf, -0.7, 0.0))
    text = hint(
        HintContext(phase="forward", kind="inf", reason="output", op=log_zero, learning_rate=note)
    )
    assert text.startswith("aten.log.default took the log of a value <= 0")
    assert "Also: the learning rate of this module's parameter group is 0.01" in text
    overflow = op("aten.exp.default", st(1.0, 95.0), output=st(2.7, math.inf))
    text = hint(
        HintContext(phase="forward", kind="inf", reason="output", op=overflow, learning_rate=note)
    )
    assert text.startswith("The learning rate of this module's parameter group is 0.01")
