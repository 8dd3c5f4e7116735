"""Merging attention computed over disjoint sets of keys (``merge_attention``)."""
import numpy as np

from . import _arrays, _config, _validate


def merge_attention(outs, lses):
    """Attention over the union of disjoint key sets, from the attention over each set.

    With ``out_i, lse_i = flash_attention(q, k_i, v_i, return_lse=True)`` for key sets ``k_i``
    that split the keys, the attention over all of them is ``out = sum_i exp(lse_i - lse)
    out_i`` with ``lse = log(sum_i exp(lse_i))``: split-KV decoding, ring attention and a
    caller's own chunking of long contexts all end with this step.

    Parameters
    ----------
    outs : sequence of arrays, each (batch, seqlen_q, nheads, headdim), or each (total_q,
        nheads, headdim) (packed batches, ``flash_attention_varlen``); or one array with the
        parts along a new first axis.
    lses : the parts' lse, (batch, nheads, seqlen_q) (packed: (nheads, total_q)), in the same
        order and form.

    Returns
    -------
    out, lse : out in the parts' dtype (added up in float32, float64 for float64 parts), lse
        float32 (float64 for float64 parts). A row whose every part saw no key (lse ``-inf``
        everywhere) gets out 0 and lse ``-inf``; a NaN in one part's row makes that row NaN.
    """
    outs, lses = _parts("outs", outs), _parts("lses", lses)
    if len(outs) != len(lses):
        raise ValueError(f"outs has {len(outs)} parts but lses has {len(lses)}")
    names = [f"outs[{i}]" for i in range(len(outs))] + [f"lses[{i}]" for i in range(len(lses))]
    arrays, kind, xp = _arrays.as_backend([*outs, *lses], names)
    outs, lses = arrays[:len(outs)], arrays[len(outs):]
    _check(outs, lses)
    with _arrays.launch_context(kind):
        out, lse = _merge(xp, outs, lses)
        return _arrays.to_caller(out, kind), _arrays.to_caller(lse, kind)


def _parts(name, parts):
    if isinstance(parts, (list, tuple)):
        parts = list(parts)
    elif hasattr(parts, "shape") and len(parts.shape) >= 1:
        parts = [parts[i] for i in range(parts.shape[0])]
    else:
        raise TypeError(f"{name} must be a sequence of arrays or an array of parts along its "
                        f"first axis, got {type(parts).__name__}")
    if not parts:
        raise ValueError(f"{name} must hold at least one part")
    return parts


def _check(outs, lses):
    out0 = outs[0]
    if out0.dtype.name not in _validate.DTYPES:
        raise TypeError(f"outs[0]: unsupported dtype {out0.dtype.name}; expected one of "
                        f"{', '.join(_validate.DTYPES)}")
    if out0.ndim not in (3, 4):
        raise ValueError(f"outs[0] must be (batch, seqlen_q, nheads, headdim) or packed (total_q, "
                         f"nheads, headdim), got shape {tuple(out0.shape)}")
    expected = ((out0.shape[0], out0.shape[2], out0.shape[1]) if out0.ndim == 4
                else (out0.shape[1], out0.shape[0]))
    allowed = ("float32", "float64") if out0.dtype.name == "float64" else ("float32",)
    for i, (o, l) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != tuple(out0.shape) or o.dtype != out0.dtype:
            raise ValueError(f"outs[{i}] is {tuple(o.shape)} {o.dtype.name}, outs[0] "
                             f"{tuple(out0.shape)} {out0.dtype.name}: the parts must agree")
        if tuple(l.shape) != expected:
            what = "(batch, nheads, seqlen_q)" if out0.ndim == 4 else "(nheads, total_q)"
            raise ValueError(f"lses[{i}] shape {tuple(l.shape)} must be {what} = {expected}")
        if l.dtype.name not in allowed:
            raise TypeError(f"lses[{i}]: dtype must be {' or '.join(allowed)} for "
                            f"{out0.dtype.name} parts, got {l.dtype.name}")
    _validate._check_devices({**{f"outs[{i}]": o for i, o in enumerate(outs)},
                              **{f"lses[{i}]": l for i, l in enumerate(lses)}})


@np.errstate(divide="ignore", invalid="ignore")   # log(0) = -inf is the answer for rows without keys
def _merge(xp, outs, lses):
    acc = xp.float64 if outs[0].dtype == np.float64 else xp.float32
    lse = xp.stack([xp.asarray(l, acc) for l in lses])
    top = lse.max(axis=0)
    # Rows without keys in every part: weights exp(-inf - 0) = 0, out 0, lse log(0) = -inf.
    base = xp.where(xp.isneginf(top), acc(0), top)
    weights = xp.exp(lse - base)
    total = weights.sum(axis=0)
    merged = base + xp.log(total)
    # lse (b, h, s) against out (b, s, h, d); packed (h, t) against (t, h, d).
    def rows(x):
        return (x.transpose(0, 2, 1) if x.ndim == 3 else x.T)[..., None]
    shown = xp.where(total > 0, total, acc(1))
    out = sum(rows(w / shown) * xp.asarray(o, acc) for w, o in zip(weights, outs))
    return out.astype(outs[0].dtype), merged.astype(_config.lse_dtype(outs[0].dtype))
