"""User mods: attention rules of the caller's own (FlexAttention's ``score_mod`` and
``mask_mod``), as CUDA C++ snippets for the GPU kernels and Python callables for the NumPy path.

A ``ScoreMod`` changes each score ``s = q.k * softmax_scale`` of query ``q_idx`` and key
``kv_idx`` of batch entry ``b`` and query head ``h`` before the softmax; a ``MaskMod`` says
whether that query sees that key. Both may read arrays the caller passes by name (a
relative-position table, document ids, ...). The GPU kernels compile the snippets in through
NVRTC (``cuda/user.cuh`` says how they are spliced) and cache them like every instantiation, by
source text. See the README's "User mods" section for a worked example.

Snippets are either one C++ expression or a function body with ``return``. Names in scope:

- ``score`` (score_mod; float in the fp16/bf16/fp32 kernels, double in the float64 ones),
  ``b``, ``h``, ``q_idx``, ``kv_idx`` (int);
- each array by its name: ``bias[i]`` reads flat element ``i``, ``bias(i, j)`` the element at
  those indices (C order), ``bias.offset(i, j)`` is its flat index, ``bias.shape(d)`` a
  dimension;
- in a gradient snippet also ``dscore`` (d loss / d the modified score) and, for each array
  named in ``grad_arrays``, ``d_<name>`` with ``d_<name>.add(flat_index, value)``. The snippet
  returns d loss / d score.
"""
import functools
import re
import weakref

import numpy as np

__all__ = ["ScoreMod", "MaskMod", "SnippetError"]

# Every live ScoreMod, MaskMod and BlockMask by its id(), weakly: how the operators of
# cupyflash.torch, whose arguments can only be tensors and numbers, find a call's object.
live = weakref.WeakValueDictionary()


class Live:
    """Base of ScoreMod, MaskMod and BlockMask: each instance enters ``live`` when it is made,
    however (built, copied or unpickled: all go through ``__new__``)."""

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        live[id(obj)] = obj
        return obj

# dtypes of the arrays a snippet may read, and their C++ element types.
CTYPES = {"bool": "bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short",
          "int32": "int", "int64": "long long", "float32": "float", "float64": "double"}
MAX_ARRAYS = 8   # per call, score_mod's and mask_mod's together (cuda/params.cuh USER_ARRAYS)
MAX_NDIM = 4
_RESERVED = {"score", "dscore", "b", "h", "q_idx", "kv_idx", "u_", "accumulate", "S"}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_RETURN = re.compile(r"\breturn\b")
# The pseudo file names of the snippets in NVRTC's messages.
SCORE_FILE, GRAD_FILE, MASK_FILE = "score_mod", "score_mod.grad", "mask_mod"


class SnippetError(ValueError):
    """A user snippet NVRTC rejects. ``log`` holds NVRTC's messages about it, with the line
    numbers of the snippet itself (``score_mod(2): error: ...``)."""

    def __init__(self, message, log):
        super().__init__(message)
        self.log = log


def _check_code(name, code):
    if code is None:
        return None
    if not isinstance(code, str) or not code.strip():
        raise TypeError(f"{name} must be a non-empty string of CUDA C++, got "
                        f"{type(code).__name__}")
    return code


def _check_callable(name, fn):
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    return fn


def _check_arrays(owner, arrays):
    """The arrays as a dict name -> array (any kind; converted with q at the call)."""
    if arrays is None:
        return {}
    if not isinstance(arrays, dict):
        raise TypeError(f"{owner} arrays must be a dict of name -> array, got "
                        f"{type(arrays).__name__}")
    for name, a in arrays.items():
        if not isinstance(name, str) or not _IDENT.match(name) or name in _RESERVED \
                or name.startswith("d_"):
            raise ValueError(f"{owner} array name {name!r} must be a C identifier, not "
                             f"starting with 'd_' and none of {sorted(_RESERVED)}")
        shape = getattr(a, "shape", None)
        if getattr(a, "dtype", None) is None or shape is None:
            raise TypeError(f"{owner} array {name!r} must be an array, got {type(a).__name__}")
        dname = _dtype_name(a)
        if dname not in CTYPES:
            raise TypeError(f"{owner} array {name!r}: dtype must be one of {sorted(CTYPES)}, got "
                            f"{dname}")
        if not 1 <= len(shape) <= MAX_NDIM or 0 in tuple(shape):
            raise ValueError(f"{owner} array {name!r} must have 1 to {MAX_NDIM} dimensions and "
                             f"no zero-size one, got shape {tuple(shape)}")
    if len(arrays) > MAX_ARRAYS:
        raise ValueError(f"{owner}: at most {MAX_ARRAYS} arrays, got {len(arrays)}")
    return dict(arrays)


def _dtype_name(a):
    """NumPy's name of an array's dtype (NumPy, CuPy, JAX, or ``torch.float32``-style)."""
    try:
        return np.dtype(a.dtype).name
    except TypeError:
        return str(a.dtype).replace("torch.", "")


def _body(code):
    """An expression becomes ``return (expr);`` on its own first line (the snippet's line
    numbers are kept); a body with ``return`` stays as it is."""
    return code if _RETURN.search(code) else f"return ({code});"


class ScoreMod(Live):
    """A rule for the scores: ``score_mod(score, b, h, q_idx, kv_idx) -> new score``.

    Parameters
    ----------
    cuda : str, optional
        The rule for the GPU kernels, a CUDA C++ expression or body (see ``cupyflash.mods``),
        e.g. ``"score + bias(h, kv_idx - q_idx + 512)"``.
    grad : str, optional
        Its gradient for ``flash_attention_backward``: returns d loss / d score from ``dscore``
        (d loss / d the modified score), e.g. ``"dscore"`` for any added bias; may add to the
        gradients of ``grad_arrays`` (``d_bias.add(bias.offset(h, kv_idx - q_idx + 512),
        dscore)``). Without it the backward refuses the mod.
    python, python_grad : callable, optional
        The same rule and gradient for NumPy inputs: ``python(score, b, h, q_idx, kv_idx,
        **arrays)`` and ``python_grad(score, dscore, b, h, q_idx, kv_idx, **arrays,
        **d_arrays)`` on NumPy arrays that broadcast together (float64 scores, int64
        indices; ``d_<name>`` float64 buffers to add into, e.g. with ``np.add.at``).
    arrays : dict of str -> array, optional
        Read-only arrays the rule uses, of q's kind and device (NumPy with NumPy inputs),
        1 to 4 dimensions, bool, integer or float dtypes. At most 8 per call with a mask_mod's.
    grad_arrays : sequence of str
        Names of float arrays whose gradient the backward returns (float32 on the GPU, float64
        for float64 inputs and on the NumPy path), as a dict after (dq, dk, dv).
    """

    def __init__(self, cuda=None, *, grad=None, python=None, python_grad=None, arrays=None,
                 grad_arrays=()):
        self.cuda = _check_code("ScoreMod cuda", cuda)
        self.grad = _check_code("ScoreMod grad", grad)
        self.python = _check_callable("ScoreMod python", python)
        self.python_grad = _check_callable("ScoreMod python_grad", python_grad)
        if self.cuda is None and self.python is None:
            raise ValueError("ScoreMod needs a rule: cuda= (GPU) and/or python= (NumPy path)")
        self.arrays = _check_arrays("ScoreMod", arrays)
        if isinstance(grad_arrays, str):
            grad_arrays = (grad_arrays,)
        self.grad_arrays = tuple(grad_arrays)
        for name in self.grad_arrays:
            if name not in self.arrays:
                raise ValueError(f"ScoreMod grad_arrays: {name!r} is not one of its arrays "
                                 f"{sorted(self.arrays)}")
            if not _dtype_name(self.arrays[name]).startswith("float"):
                raise TypeError(f"ScoreMod grad_arrays: {name!r} must be a float array to have "
                                f"a gradient, got {self.arrays[name].dtype}")

    def __repr__(self):
        return (f"ScoreMod(cuda={self.cuda!r}, grad={self.grad!r}, arrays={sorted(self.arrays)},"
                f" grad_arrays={list(self.grad_arrays)})")


class MaskMod(Live):
    """A rule for which keys a query sees: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True:
    visible).

    Parameters
    ----------
    cuda : str, optional
        The rule for the GPU, a CUDA C++ expression or body, e.g. ``"doc[q_idx] ==
        doc[kv_idx]"``.
    python : callable, optional
        The same rule for NumPy inputs: ``python(b, h, q_idx, kv_idx, **arrays)`` on
        broadcasting int64 index arrays, returning bool.
    arrays : dict of str -> array, optional
        As in ``ScoreMod``.

    A call with ``mask_mod=`` first classifies the blocks of the attention matrix as empty,
    partial or full (``cupyflash.masks.from_mask_mod``, on the GPU for GPU inputs): empty
    blocks are skipped, and only partial ones evaluate the rule per element.
    """

    def __init__(self, cuda=None, *, python=None, arrays=None):
        self.cuda = _check_code("MaskMod cuda", cuda)
        self.python = _check_callable("MaskMod python", python)
        if self.cuda is None and self.python is None:
            raise ValueError("MaskMod needs a rule: cuda= (GPU) and/or python= (NumPy path)")
        self.arrays = _check_arrays("MaskMod", arrays)

    def __repr__(self):
        return f"MaskMod(cuda={self.cuda!r}, arrays={sorted(self.arrays)})"


def _as_mod(cls, name, mod):
    """``score_mod=`` / ``mask_mod=`` of a call: a ``cls``, a plain callable (its ``python``
    rule), or None."""
    if mod is None or isinstance(mod, cls):
        return mod
    if callable(mod):
        return cls(python=mod)
    raise TypeError(f"{name} must be a cupyflash.{cls.__name__} or a callable, got "
                    f"{type(mod).__name__}")


def as_score_mod(score_mod):
    return _as_mod(ScoreMod, "score_mod", score_mod)


def as_mask_mod(mask_mod):
    return _as_mod(MaskMod, "mask_mod", mask_mod)


# --- the C++ spliced into the kernels' source ------------------------------------------------

def _ctype(a):
    return CTYPES[_dtype_name(a)]


def slots(score_mod, mask_mod):
    """``[(owner, name, array)]`` in slot order: the score_mod's arrays, then the mask_mod's."""
    out = [("score_mod", n, a) for n, a in (score_mod.arrays if score_mod else {}).items()]
    out += [("mask_mod", n, a) for n, a in (mask_mod.arrays if mask_mod else {}).items()]
    names = [n for _, n, _ in out]
    if len(set(names)) < len(names):
        raise ValueError(f"score_mod and mask_mod name their arrays alike ({sorted(names)}): "
                         f"give each array of a call its own name")
    if len(out) > MAX_ARRAYS:
        raise ValueError(f"score_mod and mask_mod use {len(out)} arrays together; at most "
                         f"{MAX_ARRAYS}")
    return out


def prelude(score_mod, mask_mod):
    """The ``struct UserMods`` of a call's snippets (cuda/user.cuh), or "" without any."""
    score = score_mod.cuda if score_mod is not None else None
    mask = mask_mod.cuda if mask_mod is not None else None
    if score is None and mask is None:
        return ""
    views = {"score_mod": [], "mask_mod": []}
    for slot, (owner, name, a) in enumerate(slots(score_mod, mask_mod)):
        views[owner].append(f"const UserArray<{_ctype(a)}, {len(a.shape)}> {name}(u_, {slot}); "
                            f"(void){name};")
    grads = []
    if score is not None:
        for slot, (owner, name, a) in enumerate(slots(score_mod, mask_mod)):
            if owner == "score_mod" and name in score_mod.grad_arrays:
                grads.append(f"const GradArray<{len(a.shape)}> d_{name}(u_, {slot}, accumulate, g_); "
                             f"(void)d_{name};")

    def function(head, decls, file, code, fallback):
        if code is None:
            return f"    {head} {{ {fallback} }}\n"
        lines = "\n".join("        " + d for d in decls)
        return (f"    {head} {{\n{lines}\n#line 1 \"{file}\"\n{_body(code)}\n"
                f"#line 1 \"cupyflash-user-mods\"\n    }}\n")

    sig = "int b, int h, int q_idx, int kv_idx"
    functions = [
        "    template <typename S>",
        function(f"static __device__ __forceinline__ S score(const UserParams& u_, S score, {sig})",
                 views["score_mod"], SCORE_FILE, score, "return score;"),
        "    template <typename S>",
        function(f"static __device__ __forceinline__ S grad(const UserParams& u_, S score, S dscore, "
                 f"{sig}, bool accumulate, UserGrads& g_)", views["score_mod"] + grads, GRAD_FILE,
                 score_mod.grad if score is not None else None, "return dscore;"),
        function(f"static __device__ __forceinline__ bool mask(const UserParams& u_, {sig})",
                 views["mask_mod"], MASK_FILE, mask, "return true;")]

    def text_of(gathers):
        flags = dict(Score=score is not None, Mask=mask is not None, Gathers=gathers)
        return "\n".join(["struct UserMods {", *(_flag(k, v) for k, v in flags.items()), *functions, "};\n"])

    # Gathers: the score_mod reads a table per score (the probe compiles the text itself, whose
    # flag it does not read).
    text = text_of(False)
    return text_of(True) if score is not None and gathers(text) else text


def _flag(name, value):
    return f"    static constexpr bool {name} = {'true' if value else 'false'};"


def reads_table(text):
    """Whether the score_mod of a ``prelude`` text reads a table per score: the Gathers flag
    that ``prelude`` set from ``gathers``, read back without a second probe."""
    return _flag("Gathers", True) in text


_PROBE = """
extern "C" __global__ void cupyflash_snippet_probe(const UserParams u, double* out) {
    UserGrads g;
    out[0] = UserMods::score<float>(u, 1.f, 0, 0, 0, 0) + UserMods::score<double>(u, 1.0, 0, 0, 0, 0)
           + UserMods::grad<float>(u, 1.f, 1.f, 0, 0, 0, 0, true, g)
           + UserMods::grad<double>(u, 1.0, 1.0, 0, 0, 0, 0, true, g)
           + UserMods::mask(u, 0, 0, 0, 0);
}
"""


@functools.lru_cache(maxsize=256)
def check_prelude(text):
    """Compile the snippets alone through NVRTC (no GPU needed) and raise SnippetError with
    NVRTC's messages about them if it rejects them."""
    _probe_ptx(text, _PROBE, "compute_80")
    return True


# A score_mod at GATHER_PROBES coordinates apart in one thread, as a kernel's score step asks it.
GATHER_PROBES = 16
_GATHER_PROBE = f"""
extern "C" __global__ void cupyflash_gather_probe(const UserParams u, float* out, int q_idx, int kv_idx) {{
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < {GATHER_PROBES}; ++i) s += UserMods::score<float>(u, 1.f, 0, 0, q_idx + i, kv_idx + 3 * i);
    out[0] = s;
}}
"""
_LOAD = re.compile(r"^\s*(@%p\d+\s+)?ld\.(?!param)", re.M)


@functools.lru_cache(maxsize=256)
def gathers(text):
    """Whether the score_mod of a ``prelude`` text reads memory per score (a table lookup at
    an offset of q_idx and kv_idx), rather than once for all of a thread's scores (a slope per
    head) or not at all: the loads in the PTX of GATHER_PROBES calls at distinct coordinates
    (one thread; loads of one address merge), at least one per call. NVRTC alone, no GPU."""
    return len(_LOAD.findall(_probe_ptx(text, _GATHER_PROBE, "compute_90"))) >= GATHER_PROBES


def _probe_ptx(text, probe, arch):
    """The PTX of cuda/user.cuh with a ``prelude`` text and a ``probe`` kernel after it, by
    NVRTC alone; SnippetError with NVRTC's messages about the snippets if it rejects them."""
    from cupy_backends.cuda.libs import nvrtc
    from . import _compile
    prog = nvrtc.createProgram(_compile.source("user.cuh", text) + probe, "cupyflash-user-mods", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*_compile.NVRTC_OPTIONS, f"-arch={arch}"])
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            raise SnippetError(_snippet_message(log), log) from None
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def _snippet_message(log):
    """NVRTC's errors, and where in the snippets they come from (their own line numbers)."""
    names = (SCORE_FILE, GRAD_FILE, MASK_FILE)
    lines = log.splitlines()
    shown = [line.strip() for line in lines
             if "error" in line or any(f" of {n}" in line for n in names)]
    return "a user snippet does not compile (NVRTC):\n" + "\n".join(shown or lines)
