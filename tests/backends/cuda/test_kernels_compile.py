"""Every kernels/*.cu compiles with NVRTC for Ampere and Hopper, on a machine without a GPU (the CI check).

NVRTC 13 has no cuda_fp16.h/cuda_bf16.h built in, so the kernels use none: the test also proves that
they need no header beyond the project's own (inlined by the CUDA backend's loader.kernel_source).
"""

from __future__ import annotations

import functools
import re

import pytest

from llamacli.backends.cuda import loader as K

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs cupy + nvidia-cuda-nvrtc")


def _nvrtc_works() -> bool:
    try:
        nvrtc.getVersion()
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _nvrtc_works(), reason="NVRTC library not loadable")


@functools.lru_cache(maxsize=None)
def ptx(family: str, arch: str) -> str:
    """K.compile_ptx, once per (family, arch) in this module: NVRTC is slow on a small CI machine."""
    return K.compile_ptx(family, arch)


def test_kernels_dir_holds_every_family() -> None:
    d = K.kernels_dir()
    assert d.is_dir()
    assert {p.stem for p in d.glob("*.cu")} == set(K.FAMILIES)


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("family", K.FAMILIES)
def test_family_compiles(family: str, arch: str) -> None:
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx(family, arch)))
    assert entries, f"{family}.cu defines no kernel"
    source = K.kernel_source(family)
    assert "#include <" not in source, "kernels must not need system headers (NVRTC 13 lacks them)"
    for name in re.findall(r'extern "C" __global__ void\s+(?:__launch_bounds__\(\d+\)\s+)?(\w+)\(', source):
        assert name == "__launch_bounds__" or name in entries  # (macro-built names checked below)


def test_every_weight_type_has_its_kernels() -> None:
    from llamacli.backends.cuda import RUNNABLE, qname

    both = ptx("matvec", "compute_90") + ptx("dequant", "compute_90")
    for t in RUNNABLE:
        for kind in ("matvec_{}", "matvec_{}_swiglu", "matvec_{}_geglu", "mv1_{}_geglu", "dequant_{}", "embed_{}"):
            assert f".entry {kind.format(qname(t))}(" in both


def test_compile_error_names_the_file(tmp_path) -> None:
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void k() { this is not C++; }\n')
    with pytest.raises(K.KernelCompileError, match=r"broken\.cu[\s\S]*error"):
        K.compile_ptx("broken", "compute_90", directory=tmp_path)


def test_every_file_opens_with_its_comment() -> None:
    for p in K.kernels_dir().glob("*.cu"):
        first = p.read_text().splitlines()[0]
        assert first.startswith(f"// {p.name}:"), p.name


def test_backend_cuda_without_cupy_says_how_to_install(monkeypatch) -> None:
    import sys

    from llamacli.backends import select_backend
    from llamacli.backends.cuda import cuda_available
    from llamacli.errors import BackendError

    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    ok, reason = cuda_available()
    assert not ok and "pip install 'llamacli[cuda12]'" in reason and "[cuda13]" in reason
    with pytest.raises(BackendError, match=r"CuPy is not installed.*pip install 'llamacli\[cuda12\]'"):
        select_backend("cuda")


def test_attention_has_hopper_code_only_for_sm90a() -> None:
    """attention_wgmma.cu's kernels: real code when compiled for sm_90a (as the loader does on a Hopper GPU),
    a trap for any other target, and the same kernel list everywhere; it is the only family built for sm_90a,
    and the other attention families hold no wgmma code."""
    hopper = ptx("attention_wgmma", "compute_90a")
    plain = ptx("attention_wgmma", "compute_90")
    assert "wgmma.mma_async" in hopper and "wgmma" not in plain
    assert set(re.findall(r"\.entry\s+(\w+)\(", hopper)) == set(re.findall(r"\.entry\s+(\w+)\(", plain))
    assert K.FEATURE_ARCH == {"attention_wgmma": ("90", "sm_90a")}
    for family in ("attention_simt", "attention_split", "attention_mma"):
        assert "wgmma" not in re.sub(r"//[^\n]*", "", K.kernel_source(family)), family


ATTENTION_KERNELS = {  # the kernels of the four attention families, as the Python launchers name them
    "attention_simt": {"kv_store", "kv_store_q8", "kv_dequant_q8", "attention_combine", "attention_combine_w",
                       "attention_combine_batch"}
    | {f"attention{w}_npl{n}" for w in ("", "_w", "_batch") for n in (1, 2, 3, 4, 8)}
    | {"attention_npl16", "attention_w_npl16"},  # (heads of 512: gemma4's global layers, op by op)
    "attention_split": {f"attention_split{s}_d{d}" for s in ("", "_step_normal", "_step_neox")
                        for d in (64, 80, 96, 112, 128, 256)}
    | {f"attention_split{s}_d{d}" for s in ("_q8", "_step_q8_normal", "_step_q8_neox") for d in (64, 96, 128, 256)},
    "attention_mma": {f"attention_tc{x}{o}_d{d}" for x in ("", "x") for o in ("", "16")
                      for d in (64, 80, 96, 112, 128, 256)},
    "attention_wgmma": {f"attention_wg{o}_d{d}" for o in ("", "16") for d in (64, 128)},
}


@pytest.mark.parametrize("family", sorted(ATTENTION_KERNELS))
def test_attention_families_define_exactly_their_kernels(family: str) -> None:
    """Each attention family compiles to exactly the kernels its launchers fetch from it (no kernel lost or
    defined twice across the four files)."""
    assert set(re.findall(r"\.entry\s+(\w+)\(", ptx(family, "compute_90"))) == ATTENTION_KERNELS[family]


def test_feature_cubin_is_compiled_once_into_the_cache(tmp_path, monkeypatch) -> None:
    """attention_wgmma.cu for sm_90a: a cubin under $LLAMACLI_HOME/kernels named by family, target and a hash
    of the source; a second call finds it (no compile); another source, another file."""
    monkeypatch.setenv("LLAMACLI_HOME", str(tmp_path))
    src = K.kernel_source("attention_wgmma")
    path = K.feature_cubin("attention_wgmma", src, "sm_90a")
    assert path.parent == tmp_path / "kernels" and path.name.startswith("attention_wgmma-sm_90a-")
    assert path.read_bytes()[:4] == b"\x7fELF"  # a cubin
    stamp = path.stat().st_mtime_ns
    assert K.feature_cubin("attention_wgmma", src, "sm_90a") == path and path.stat().st_mtime_ns == stamp
    other = K.feature_cubin("attention_wgmma", src + "\n// edited\n", "sm_90a")
    assert other != path and other.is_file()
    assert not list(path.parent.glob("*.part"))


def test_gemma_elementwise_and_norm_kernels_exist() -> None:
    """The kernels the gemma paths launch: GeGLU (op path, fused prefill, 16-bit streaming matvec), the
    soft-cap, the embedding scale and the post-norm residual add."""
    ew, norm, mv = ptx("elementwise", "compute_90"), ptx("norm", "compute_90"), ptx("matvec", "compute_90")
    for name in ("geglu_f32", "geglu_f16_rowscale", "softcap_f32", "scale_f32"):
        assert f".entry {name}(" in ew, name
    assert ".entry rms_norm_add(" in norm
    for t in ("f16", "bf16"):
        assert f".entry mv1_stream_{t}_geglu(" in mv
