"""The kernels' typed launchers (cuda/declarations.py), checked without a GPU: every kernel declaration in
kernels/*.cu is read, every argument converts to its C type or is refused by name, and every launch in the
backend passes exactly the arguments its kernel declares (read from the call sites' source)."""

from __future__ import annotations

import ast
import itertools
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from llamacli.backends.cuda import declarations as D, loader as K
from llamacli.backends.cuda.attention import ATT_TC_DIMS
from llamacli.backends.cuda.linear import RUNNABLE, qname

ROOT = Path(__file__).resolve().parents[3]


class FakeArray:
    """What the launcher reads of a cupy array: its device address."""

    def __init__(self, address: int):
        self.data = type("Mem", (), {"ptr": address})()


def test_every_kernel_declaration_reads() -> None:
    for family in K.FAMILIES:
        sigs = D.declarations(family)
        own = (K.kernels_dir() / f"{family}.cu").read_text(encoding="utf-8")
        assert len(sigs) == len(re.findall(r'extern\s+"C"\s+__global__', own)), family  # none missed
        for sig in sigs:
            assert len(set(sig.names)) == len(sig.names), sig.pattern
            # `shared` is launch()'s own keyword: no kernel may name a parameter so.
            assert "shared" not in sig.names, sig.pattern
    headers = "".join(p.read_text(encoding="utf-8") for p in K.kernels_dir().glob("*.cuh"))
    assert "__global__" not in headers  # declarations() reads each family's own file


@pytest.mark.skipif(shutil.which("cpp") is None, reason="no C preprocessor")
def test_every_concrete_kernel_resolves_to_its_own_declaration() -> None:
    """The C preprocessor stamps out every macro-made kernel (mv1_q4_k_swiglu, attention_split_step_q8_neox_d128,
    ...): each name must resolve to the declaration with its own parameters."""
    total = 0
    for family in K.FAMILIES:
        src = re.sub(r"^\s*#\s*include\s*<[^>]*>\s*$", "", K.kernel_source(family), flags=re.M)
        out = subprocess.run(["cpp", "-P", "-x", "c++", "-"], input=src, capture_output=True, text=True, check=True)
        for concrete in D.read_declarations(out.stdout, family):
            assert D.signature(family, concrete.pattern).params == concrete.params, (family, concrete.pattern)
            total += 1
    assert total > 300


def test_the_most_specific_declaration_serves_a_name() -> None:
    assert D.signature("matvec", "mv1_q4_k").pattern == "mv1_##name"
    assert D.signature("matvec", "mv1_q4_k_swiglu").pattern == "mv1_##name##_swiglu"
    assert D.signature("matvec", "mv1_stream_f16_geglu").pattern == "mv1_stream_##name##_geglu"
    assert D.signature("matvec", "mv1_mixed_q4_k_q6_k").pattern == "mv1_mixed_##a##_##b"
    assert D.signature("matvec", "mv1_tile_q8_0").pattern == "mv1_tile_q8_0"
    step = D.signature("attention_split", "attention_split_step_q8_neox_d128")
    assert step.pattern.startswith("attention_split_step") and "early" in step.names
    assert D.signature("attention_split", "attention_split_d128").pattern == "attention_split##SFX##_d##D"
    with pytest.raises(TypeError, match="declares no kernel"):
        D.signature("norm", "no_such_kernel")


def test_pack_converts_each_argument_to_its_declared_type_in_declaration_order() -> None:
    sig = D.signature("elementwise", "rowscale_bias_f32")  # (float* y, const float* scale, const float* b,
    assert sig.names == ("y", "scale", "b", "n", "N")  #      long long n, int N)
    got = sig.pack("rowscale_bias_f32", dict(N=7, n=1 << 40, b=None, scale=0x1000, y=FakeArray(0xABC0)))
    assert [type(v) for v in got] == [np.uint64, np.uint64, np.uint64, np.int64, np.int32]
    assert [int(v) for v in got] == [0xABC0, 0x1000, 0, 1 << 40, 7]
    real = D.signature("elementwise", "scale_f32").pack("scale_f32", dict(x=1, y=2, s=0.5, n=3))
    assert type(real[2]) is np.float32 and real[2] == 0.5
    dbl = D.signature("sampling", "sample_topk_f32")
    vals = dbl.pack("sample_topk_f32", dict(vals=1, ids=2, k=3, top_p=0.9, log_min_p=-np.inf, temperature=1,
                                            u=0.25, out=4))
    assert [type(v) for v in vals[3:7]] == [np.float64] * 4


@pytest.mark.parametrize("args, message", [
    (dict(x=1, y=2, s=0.5), r"missing argument\(s\) n$"),
    (dict(x=1, y=2, s=0.5, n=3, m=4), r"unknown argument\(s\) m$"),
    (dict(x=1, y=2, s=0.5, nn=3), r"missing argument\(s\) n; unknown argument\(s\) nn"),
    (dict(x=1, y=2, s=0.5, n=3.0), "argument n: an integer, not float"),
    (dict(x=1, y=2, s=0.5, n=1 << 63), "argument n: .* outside long long's range"),
    (dict(x=1, y=2, s="0.5", n=3), "argument s: a real number, not str"),
    (dict(x=np.zeros(3), y=2, s=0.5, n=3), "argument x: a device array, an address or None"),
    (dict(x=-1, y=2, s=0.5, n=3), "argument x: an address outside"),
])
def test_pack_refuses_by_name(args, message) -> None:
    with pytest.raises(TypeError, match=message):
        D.signature("elementwise", "scale_f32").pack("scale_f32", args)


def test_flags_and_numpy_scalars_convert() -> None:
    sig = D.signature("norm", "rms_norm_f32")
    got = sig.pack("rms_norm_f32", dict(x=np.uint64(16), w=None, y=np.int64(32), D=np.bool_(True), eps=np.float16(0.5)))
    assert [int(v) for v in got[:4]] == [16, 0, 32, 1] and got[4] == np.float32(0.5)
    wg = D.signature("attention_wgmma", "attention_wg_d128")
    with pytest.raises(TypeError, match="argument kmap: the 128 bytes of a TmaMap"):
        wg.pack("attention_wg_d128", dict(q=1, q_stride=1, kmap=np.zeros(3), vmap=np.zeros(128, np.uint8), pos=1,
                                          T=1, Hq=1, Hkv=1, out=1, out_stride=1))


def test_int_parameters_refuse_values_past_32_bits() -> None:
    sig = D.signature("norm", "rms_norm_f32")
    with pytest.raises(TypeError, match="argument D: .* outside int's range"):
        sig.pack("rms_norm_f32", dict(x=1, w=2, y=3, D=1 << 31, eps=1e-5))


def test_declarations_read_macros_comments_and_struct_parameters() -> None:
    src = """
    // extern "C" __global__ void commented_out(int a) {}
    #define K(name, Q) \\
        extern "C" __global__ void __launch_bounds__(256, 2) k_##name##_x(const u8* __restrict__ w, /* rows */ \\
            int N, long long eb, const double* t, unsigned int flags) {}
    extern "C" __global__ void tma(const __grid_constant__ TmaMap map, float s) {}
    extern "C" __global__ void none() {}
    """
    sigs = {s.pattern: s for s in D.read_declarations(src, "x")}
    assert set(sigs) == {"k_##name##_x", "tma", "none"}
    assert [(p.name, p.ctype) for p in sigs["k_##name##_x"].params] == [
        ("w", "pointer"), ("N", "int"), ("eb", "long long"), ("t", "pointer"), ("flags", "unsigned int")]
    assert [(p.name, p.ctype) for p in sigs["tma"].params] == [("map", "TmaMap"), ("s", "float")]
    assert sigs["none"].params == ()
    with pytest.raises(ValueError, match="no launcher type"):
        D.read_declarations('extern "C" __global__ void f(half h) {}', "x")


# -- every launch in the backend against its kernel's declaration -------------------------------------------

# The values each f-string placeholder of a kernel name takes, by the placeholder's expression.
_QNAMES = sorted(qname(t) for t in RUNNABLE)
_DIMS = [str(d) for d in ATT_TC_DIMS]
_PLACEHOLDERS = {"w_": ["", "_w"], "f16": ["", "16"], "npl": ["1", "2", "4", "8", "16"], "dh": _DIMS,
                 "cfg.head_dim": _DIMS, "g.head_dim": _DIMS, "mode": ["normal", "neox"], "glu": ["swiglu", "geglu"],
                 "act": ["swiglu", "oai"], "_ACT[op.activation]": ["swiglu", "oai", "geglu"],
                 "nt": ["8", "16", "32", "64"]}


def _placeholder(v: ast.FormattedValue) -> list[str]:
    e = v.value
    if isinstance(e, ast.IfExp) and isinstance(e.body, ast.Constant) and isinstance(e.orelse, ast.Constant):
        return [e.body.value, e.orelse.value]
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "qname":
        return _QNAMES
    return _PLACEHOLDERS[ast.unparse(e)]


def _launches() -> list[tuple[str, int, ast.Call, ast.AST, ast.Module]]:
    """Every K.launch call in llamacli/: (file, line, the call, its enclosing function, the module)."""
    out = []
    for path in sorted((ROOT / "llamacli").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.Lambda)):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "launch"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "K"):
                    out.append((str(path.relative_to(ROOT)), node.lineno, node, fn, tree))
    seen, unique = set(), []
    for item in out:  # (a call inside a lambda inside a function: once, with the outermost function)
        if id(item[2]) not in seen:
            seen.add(id(item[2]))
            unique.append(item)
    return unique


def _key_sets(expr: ast.expr, fn: ast.AST, module: ast.Module) -> list[frozenset[str]]:
    """The key sets a `**expr` argument may carry: dict(...) calls, dict displays, `{k: ... for k in (...)}`,
    either branch of a conditional, the earlier value of a name in its function, or what a method of the
    module returns."""
    if isinstance(expr, ast.IfExp):
        return _key_sets(expr.body, fn, module) + _key_sets(expr.orelse, fn, module)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict":
        return [frozenset(k.arg for k in expr.keywords)]
    if isinstance(expr, ast.DictComp):
        return [frozenset(e.value for e in expr.generators[0].iter.elts)]
    if isinstance(expr, ast.Dict):
        sets = [frozenset()]
        for k, v in zip(expr.keys, expr.values):
            if k is None:  # {**other, ...}
                sets = [a | b for a in sets for b in _key_sets(v, fn, module)]
            else:
                sets = [a | {k.value} for a in sets]
        return sets
    if isinstance(expr, ast.Name):
        sets = []
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and node.value is not expr:
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id == expr.id:
                        sets += _key_sets(node.value, fn, module)
                    elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        for t, v in zip(target.elts, node.value.elts):
                            if isinstance(t, ast.Name) and t.id == expr.id and not (
                                    isinstance(v, ast.Dict) and None in v.keys):
                                sets += _key_sets(v, fn, module)
                            elif isinstance(t, ast.Name) and t.id == expr.id:  # {**args, more}: the earlier + more
                                extra = _key_sets(ast.Dict([k for k in v.keys if k is not None],
                                                           [x for k, x in zip(v.keys, v.values) if k is not None]),
                                                  fn, module)
                                sets += [a | b for a in list(sets) for b in extra]
        assert sets, f"cannot follow **{expr.id}"
        return sets
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        for node in ast.walk(module):
            if isinstance(node, ast.FunctionDef) and node.name == expr.func.attr:
                rets = [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value is not None]
                return [k for r in rets for k in _key_sets(r, node, module)]
    raise AssertionError(f"cannot follow **{ast.unparse(expr)}")


def _names(node: ast.expr, variables: dict[str, list[str]]) -> list[str]:
    """The concrete kernel names a call's name expression may take."""
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _names(node.body, variables) + _names(node.orelse, variables)
    if isinstance(node, ast.Name):
        return variables[node.id]
    assert isinstance(node, ast.JoinedStr), ast.unparse(node)
    pieces = [[v.value] if isinstance(v, ast.Constant) else _placeholder(v) for v in node.values]
    return ["".join(p) for p in itertools.product(*pieces)]


# Names held in a variable at the call: every value the code assigns to it there.
_VARIABLES = {
    ("linear.py", "kernel"): ["mv1_q4_k", "mv1_mixed_q4_k_q6_k"],
    ("ops.py", "kernel"): ["swiglu_f32", "geglu_f32"],
    ("decode.py", "glu"): ["swiglu_f32", "geglu_f32"],
    ("prefill.py", "glu"): ["swiglu_f16_rowscale", "geglu_f16_rowscale"],
    ("prefill.py", "kernel"): ["rope_store_pf_normal", "rope_store_pf_neox", "rope_store_pf_qkn_normal",
                               "rope_store_pf_qkn_neox"],
}


def test_every_launch_passes_what_its_kernel_declares() -> None:
    calls = _launches()
    assert len(calls) >= 60
    for path, line, call, fn, module in calls:
        family = call.args[0].value
        assert family in K.FAMILIES, (path, line)
        assert len(call.args) == 4, f"{path}:{line}: arguments by name only"
        variables = {name: v for (file, name), v in _VARIABLES.items() if path.endswith(file)}
        sigs = set()
        for name in _names(call.args[1], variables):
            try:
                sigs.add(D.signature(family, name))
            except TypeError:
                continue
        assert sigs, f"{path}:{line}: no kernel of kernels/{family}.cu matches"
        named = frozenset(k.arg for k in call.keywords if k.arg is not None) - {"shared"}
        # Each **splat may carry one of several key sets: some choice of them must give exactly the kernel's.
        splats = [_key_sets(k.value, fn, module) for k in call.keywords if k.arg is None]
        passed = [named.union(*choice) for choice in itertools.product(*splats)]
        for sig in sigs:
            assert set(sig.names) in passed, (
                f"{path}:{line} {sig.pattern}: passes one of {[sorted(p) for p in passed]}, declares {sig.names}")
            for p in passed:
                assert p <= set(sig.names) or any(set(other.names) == p for other in sigs), (
                    f"{path}:{line} {sig.pattern}: unknown {sorted(p - set(sig.names))}")
