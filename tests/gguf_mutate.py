"""Broken GGUF files on demand: a structural parser/serializer for GGUF bytes, the seed corpus (tiny synthetic
models and real files), and seeded mutators, one per class of hostile input.

A file is handled as `Sample(prefix, size)`: the first bytes and the total size; the rest are zeros. That lets
a real 98 MB model take part through its header alone (the tensor data becomes a hole in a sparse file).

    parse(bytes) -> Layout (kvs with raw value bytes, tensor infos, every field's offset and kind)
    Layout.build() -> bytes (header + padding + data), after structural edits
    MUTATORS[name](rng, base) -> Sample: one mutant of a seed file
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import gguf_bytes as gb
from gguf_bytes import ARR, BOOL, F32, F64, I8, I16, I32, I64, STR, U8, U16, U32, U64

_SIZE = {U8: 1, I8: 1, BOOL: 1, U16: 2, I16: 2, U32: 4, I32: 4, F32: 4, U64: 8, I64: 8, F64: 8}
_FMT = {U8: "<B", I8: "<b", BOOL: "<?", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", U64: "<Q", I64: "<q", F64: "<d"}


@dataclass(frozen=True)
class Sample:
    prefix: bytes
    size: int  # total file size; bytes past the prefix are zeros


@dataclass(frozen=True)
class Field:
    start: int
    size: int
    kind: str  # magic version count strlen str vtype itype arrlen value ndims dim ttype offset data


@dataclass
class KV:
    key: bytes
    vtype: int
    raw: bytes  # the value as stored (for ARR: item type, count, items)

    def encode(self) -> bytes:
        return struct.pack("<Q", len(self.key)) + self.key + struct.pack("<I", self.vtype) + self.raw

    def value(self) -> Any:
        return _decode(self.vtype, self.raw, 0)[0]

    @property
    def name(self) -> str:
        return self.key.decode("utf-8", "replace")


@dataclass
class Tensor:
    name: bytes
    dims: list[int]  # fastest first, as stored
    ggml_type: int
    offset: int
    n_dims: int | None = None  # a lying dimension count (None: len(dims))

    def encode(self) -> bytes:
        n = len(self.dims) if self.n_dims is None else self.n_dims
        return (struct.pack("<Q", len(self.name)) + self.name + struct.pack("<I", n)
                + b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in self.dims)
                + struct.pack("<IQ", self.ggml_type & 0xFFFFFFFF, self.offset & (2**64 - 1)))


@dataclass
class Layout:
    version: int
    kvs: list[KV]
    tensors: list[Tensor]
    data: bytes  # the stored part of the data section
    data_size: int  # its full size (larger than len(data) for a sparse sample)
    fields: list[Field] = field(default_factory=list)
    data_offset: int = 0
    pad: bool = True  # a file without tensors may end right after its metadata, unpadded

    @property
    def alignment(self) -> int:
        for kv in self.kvs:
            if kv.key == b"general.alignment" and kv.vtype == U32:
                a = struct.unpack("<I", kv.raw)[0]
                if a and not a & (a - 1) and a <= 1 << 20:  # (a 2^31 alignment would pad mutants to 2 GB)
                    return a
        return 32

    def build(self, *, n_kv: int | None = None, n_tensors: int | None = None, magic: bytes = b"GGUF",
              version: int | None = None) -> Sample:
        head = magic + struct.pack(
            "<IQQ", self.version if version is None else version,
            (len(self.tensors) if n_tensors is None else n_tensors) & (2**64 - 1),
            (len(self.kvs) if n_kv is None else n_kv) & (2**64 - 1),
        )
        body = head + b"".join(kv.encode() for kv in self.kvs) + b"".join(t.encode() for t in self.tensors)
        if self.pad or self.tensors:
            body += b"\0" * ((-len(body)) % self.alignment)
        return Sample(body + self.data, len(body) + self.data_size)

    def copy(self) -> "Layout":
        return Layout(self.version, [replace(k) for k in self.kvs], [replace(t, dims=list(t.dims)) for t in self.tensors],
                      self.data, self.data_size, self.fields, self.data_offset, self.pad)

    def kv(self, key: str) -> KV | None:
        return next((k for k in self.kvs if k.key == key.encode()), None)

    def set(self, key: str, vtype: int, value: Any) -> None:
        """Set (or add) a key with a value encoded as `vtype` (gguf_bytes.value conventions)."""
        raw = gb.value(vtype, value)
        old = self.kv(key)
        if old is None:
            self.kvs.append(KV(key.encode(), vtype, raw))
        else:
            old.vtype, old.raw = vtype, raw


def _decode(vtype: int, buf: bytes, pos: int) -> tuple[Any, int]:
    if vtype in _FMT:
        return struct.unpack_from(_FMT[vtype], buf, pos)[0], pos + _SIZE[vtype]
    if vtype == STR:
        n = struct.unpack_from("<Q", buf, pos)[0]
        return buf[pos + 8 : pos + 8 + n].decode("utf-8", "surrogateescape"), pos + 8 + n
    itype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    out = []
    for _ in range(count):
        v, pos = _decode(itype, buf, pos)
        out.append(v)
    return (itype, out), pos


def parse(sample: Sample) -> Layout:
    """Parse a valid GGUF sample (trusting it), recording every field."""
    buf = sample.prefix
    fields: list[Field] = []
    pos = 0

    def take(n: int, kind: str) -> bytes:
        nonlocal pos
        fields.append(Field(pos, n, kind))
        pos += n
        return buf[pos - n : pos]

    def u32(kind: str) -> int:
        return struct.unpack("<I", take(4, kind))[0]

    def u64(kind: str) -> int:
        return struct.unpack("<Q", take(8, kind))[0]

    def string() -> bytes:
        return take(u64("strlen"), "str")

    def value(vtype: int) -> None:
        if vtype in _SIZE:
            take(_SIZE[vtype], "value")
        elif vtype == STR:
            string()
        else:
            itype = u32("itype")
            count = u64("arrlen")
            if itype in _SIZE:  # one field for the whole numeric array (items are not boundaries worth cutting)
                take(_SIZE[itype] * count, "value")
            else:
                for _ in range(count):
                    value(itype)

    take(4, "magic")
    version = u32("version")
    n_tensors, n_kv = u64("count"), u64("count")
    kvs = []
    for _ in range(n_kv):
        key = string()
        vtype = u32("vtype")
        start = pos
        value(vtype)
        kvs.append(KV(key, vtype, buf[start:pos]))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        n_dims = u32("ndims")
        dims = [u64("dim") for _ in range(n_dims)]
        tensors.append(Tensor(name, dims, u32("ttype"), u64("offset")))
    layout = Layout(version, kvs, tensors, b"", 0, fields)
    data_offset = pos + (-pos) % layout.alignment
    if data_offset > sample.size:
        layout.pad, data_offset = False, pos
    layout.data_offset = data_offset
    layout.data = buf[data_offset:]
    layout.data_size = sample.size - data_offset
    for t in sorted(tensors, key=lambda t: t.offset):
        fields.append(Field(data_offset + t.offset, 1, "data"))
    return layout


# -- the seed corpus --------------------------------------------------------------------------------------------


def spm_vocab() -> dict[str, Any]:
    """A small SentencePiece (tokenizer.ggml.model = llama) vocabulary, byte fallback, a Llama 2 template."""
    pieces = ["\u2581", "\u2581t", "he", "\u2581the", "\u2581a", "in", "er", "on", "\u2581s", "re", "at", "\u2581w"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": (
            "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
            "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
        ),
    }


def write_seed_models(root: Path) -> dict[str, Path]:
    """Tiny synthetic models (one per architecture and tokenizer kind) and a vocabulary-only file."""
    from gguf import GGUFWriter

    from llamacli.testing import ModelSpec, add_metadata, tiny_vocab, write_model

    root.mkdir(parents=True, exist_ok=True)
    micro = ModelSpec("llama", 1, 32, 2, 1, 64, context_length=128, name="micro-llama")
    out = {
        "llama-bpe-f32": write_model(root / "llama-bpe-f32.gguf", micro, "F32", vocab=tiny_vocab()),
        "qwen2-bpe-q8_0": write_model(root / "qwen2-bpe-q8_0.gguf", replace(micro, arch="qwen2", tied=True, name="micro-qwen2"),
                                      "Q8_0", vocab=tiny_vocab()),
        "phi3-spm-f16": write_model(root / "phi3-spm-f16.gguf", replace(micro, arch="phi3", n_head_kv=2, name="micro-phi3",
                                                                         rope_scaling="longrope"), "F16", vocab=spm_vocab()),
        "llama3-spm-q4_0": write_model(root / "llama3-spm-q4_0.gguf", replace(micro, rope_scaling="llama3", rope_factor=8.0),
                                       "Q4_0", vocab=spm_vocab()),
        # a mixture of experts: 3-D MXFP4 experts, their [E, F] biases, sinks, a window, YaRN
        "gpt-oss-bpe-mxfp4": write_model(root / "gpt-oss-bpe-mxfp4.gguf", replace(
            micro, arch="gpt-oss", n_layer=2, rope_scaling="yarn", rope_factor=2.0, window=4, n_expert=4,
            n_expert_used=2, n_ff_exp=32, name="micro-gpt-oss"), "MXFP4_MOE", vocab=tiny_vocab()),
        # a hybrid: a Gated DeltaNet layer (its ssm.* keys, recurrent-layer flags, a convolution) and a gated
        # attention layer with RoPE sections, experts and a shared expert, and an MTP block read past
        "qwen35moe-bpe-q8_0": write_model(root / "qwen35moe-bpe-q8_0.gguf", replace(
            micro, arch="qwen35moe", n_layer=2, n_ff=0, head_dim=16, rope_dim=4, n_expert=4, n_expert_used=2,
            n_ff_exp=32, n_ff_shexp=32, ssm_state_size=8, ssm_group_count=1, ssm_time_step_rank=2,
            full_attention_interval=2, n_mtp=1, name="micro-qwen35moe"), "Q8_0", vocab=tiny_vocab()),
        # Gemma 4: sliding and global layers of their own head sizes and KV heads, two layers sharing the first
        # two's KV, per-layer embeddings, experts beside the dense FFN, V = K on global layers (its per-layer keys)
        "gemma4-bpe-q8_0": write_model(root / "gemma4-bpe-q8_0.gguf", replace(
            micro, arch="gemma4", n_layer=4, head_dim=32, head_dim_swa=16, n_head_kv_global=1, window=4,
            swa_layers=(True, False, True, False), n_kv_shared=2, n_embd_per_layer=8, n_expert=4, n_expert_used=2,
            n_ff_exp=32, k_eq_v=True, final_softcap=30.0, name="micro-gemma4"), "Q8_0", vocab=tiny_vocab()),
    }
    vocab_only = root / "vocab-only-bpe.gguf"
    w = GGUFWriter(str(vocab_only), "llama")
    w.add_name("vocab-only")
    for key, value in tiny_vocab().items():
        add_metadata(w, key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    out["vocab-only-bpe"] = vocab_only
    return out


def sample_of(path: Path, header_only: bool = False) -> Sample:
    """A file as a Sample; header_only keeps only the header (the data becomes zeros: a sparse file)."""
    size = path.stat().st_size
    if not header_only:
        return Sample(path.read_bytes(), size)
    from llamacli.ggufio.file import open_gguf

    with open_gguf(path) as g:
        n = g.data_offset
    with open(path, "rb") as f:
        return Sample(f.read(n), size)


# -- mutators ---------------------------------------------------------------------------------------------------

_HUGE = [2**64 - 1, 2**63, 2**63 - 1, 2**62, 2**48, 2**40, 2**32, 2**32 - 1, 2**31, 2**24 + 1, 2**20]
_NONFINITE = [math.nan, math.inf, -math.inf, -math.nan, 3.4e38, -3.4e38, 1e-45, -0.0, 0.0]
_BAD_UTF8 = [b"\xff", b"\x80", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\xf4\x90\x80\x80"]
_CONFIG_KEYS = [
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
    "rope.freq_base", "attention.layer_norm_rms_epsilon", "vocab_size", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.attn_factor",
]
_OTHER_KEYS = [
    "general.architecture", "general.alignment", "general.name", "tokenizer.ggml.model", "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
]


def _hostile_value(rng: random.Random) -> tuple[int, Any]:
    """A (GGUF type, value) pair chosen to hurt: extremes, wrong kinds, non-finite floats, odd strings, arrays."""
    choice = rng.randrange(12)
    if choice == 0:
        return U32, rng.choice([0, 1, 2, 3, 5, 7, 31, 33, 2**31 - 1, 2**31, 2**32 - 1])
    if choice == 1:
        return I32, rng.choice([-1, -2, -(2**31), 0])
    if choice == 2:
        return U64, rng.choice(_HUGE + [0, 1])
    if choice == 3:
        return I64, rng.choice([-1, -(2**63), 2**63 - 1])
    if choice == 4:
        return F32, rng.choice(_NONFINITE + [0.5, 1.0, 1e-5, 10000.0])
    if choice == 5:
        return F64, rng.choice([math.nan, math.inf, 1e308, 5e-324, -1.0])
    if choice == 6:
        return BOOL, rng.choice([True, False])
    if choice == 7:
        return STR, rng.choice(["", "x" * 5000, "\x00", "[/INST]", "[bold red]x", "llama", "gpt2", "qwen2", "phi3",
                                "none", "linear", "yarn", "llama3", "{{ 7*7 }}", "{% for x in range(10**9) %}"])
    if choice == 8:
        return ARR, (U32, rng.choice([[], [1], [0, 1], [2**32 - 1], list(range(64))]))
    if choice == 9:
        return ARR, (STR, rng.choice([[], [""], ["a", "a"], ["Ġ t"], ["x" * 3000]]))
    if choice == 10:
        return ARR, (F32, rng.choice([[math.nan], [math.inf, 1.0], []]))
    return ARR, (I64, [-1, 2**62])


def _strings(layout: Layout) -> list[Field]:
    return [f for f in layout.fields if f.kind == "str" and f.size > 0]


def m_bitflip_header(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    buf = bytearray(base.prefix)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(layout.data_offset)
        buf[i] ^= 1 << rng.randrange(8)
    return Sample(bytes(buf), base.size)


def m_bitflip_any(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    buf = bytearray(base.prefix)
    for _ in range(rng.randint(1, 32)):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    return Sample(bytes(buf), base.size)


def m_random_bytes(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    buf = bytearray(base.prefix)
    i = rng.randrange(layout.data_offset)
    n = rng.randint(1, 16)
    fill = rng.choice([b"\x00", b"\xff", None])
    chunk = fill * n if fill else bytes(rng.randrange(256) for _ in range(n))
    buf[i : i + n] = chunk[: len(buf) - i]
    return Sample(bytes(buf), base.size)


def m_splice(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    """Insert or delete a run of header bytes (everything after it shifts)."""
    buf = base.prefix
    i = rng.randrange(layout.data_offset)
    n = rng.randint(1, 64)
    if rng.random() < 0.5:
        new = buf[:i] + buf[i : i + n] + buf[i:]
    else:
        new = buf[:i] + buf[i + n :]
    return Sample(new, base.size + len(new) - len(buf))


def m_truncate(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    f = rng.choice(layout.fields)
    cut = max(0, f.start + rng.choice([0, 0, 1, -1, f.size // 2]))
    return Sample(base.prefix[:cut], cut)


def m_huge_count(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    kinds = ("count", "strlen", "arrlen", "dim", "offset", "ndims")
    f = rng.choice([f for f in layout.fields if f.kind in kinds])
    value = rng.choice(_HUGE + [base.size, base.size - f.start, 0, 1]) & ((1 << (8 * f.size)) - 1)
    buf = bytearray(base.prefix)
    buf[f.start : f.start + f.size] = value.to_bytes(f.size, "little")
    return Sample(bytes(buf), base.size)


def m_wrong_type(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    f = rng.choice([f for f in layout.fields if f.kind in ("vtype", "itype", "ttype")])
    if f.kind == "ttype":
        value = rng.choice([*range(0, 42), 99, 2**31, 2**32 - 1])
    else:
        value = rng.choice([*range(0, 14), 255, 2**31, 2**32 - 1])
    buf = bytearray(base.prefix)
    buf[f.start : f.start + 4] = struct.pack("<I", value)
    return Sample(bytes(buf), base.size)


def m_duplicate_key(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    lay = layout.copy()
    i = rng.randrange(len(lay.kvs))
    if rng.random() < 0.5:
        lay.kvs.insert(rng.randrange(len(lay.kvs) + 1), replace(lay.kvs[i]))
    else:  # rename a key to another key's name
        j = rng.randrange(len(lay.kvs))
        lay.kvs[j] = replace(lay.kvs[j], key=lay.kvs[i].key)
    return lay.build()


def m_duplicate_tensor(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    lay = layout.copy()
    if not lay.tensors:
        return m_duplicate_key(rng, base, layout)
    a, b = rng.randrange(len(lay.tensors)), rng.randrange(len(lay.tensors))
    if a == b or rng.random() < 0.3:
        lay.tensors.append(replace(lay.tensors[a], dims=list(lay.tensors[a].dims)))
    else:
        lay.tensors[b].name = lay.tensors[a].name
    return lay.build()


def m_tensor_offset(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    lay = layout.copy()
    if not lay.tensors:
        return m_huge_count(rng, base, layout)
    t = rng.choice(lay.tensors)
    other = rng.choice(lay.tensors)
    how = rng.randrange(6)
    if how == 0:
        t.offset = other.offset  # overlap exactly
    elif how == 1:
        t.offset = other.offset + lay.alignment  # overlap partly (when other is longer than one alignment)
    elif how == 2:
        t.offset += rng.randint(1, lay.alignment - 1)  # misaligned
    elif how == 3:
        t.offset = rng.choice([lay.data_size, lay.data_size + 32, 2**64 - 32, 2**63])  # past the end
    elif how == 4:
        t.offset = max(0, t.offset - lay.alignment)  # overlaps its neighbour
    else:
        t.offset, other.offset = other.offset, t.offset  # swapped: sizes differ
    return lay.build()


def m_tensor_dims(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    lay = layout.copy()
    if not lay.tensors:
        return m_huge_count(rng, base, layout)
    t = rng.choice(lay.tensors)
    how = rng.randrange(8)
    if how == 0:
        t.dims[rng.randrange(len(t.dims))] = rng.choice([2**64 - 1, 2**63, 2**63 + 32, -32])  # "negative"
    elif how == 1:
        t.dims = [2**32, 2**32] + t.dims[2:]  # product overflows 64 bits
    elif how == 2:
        t.dims[rng.randrange(len(t.dims))] = 0
    elif how == 3:
        t.dims = list(reversed(t.dims))  # transposed
    elif how == 4:
        t.dims[-1] += rng.choice([1, -1, 32])  # rows off by one (or a block)
    elif how == 5:
        t.dims = t.dims + [1] if len(t.dims) < 4 else t.dims[:-1]
    elif how == 6:
        t.n_dims = rng.choice([0, 5, 2**32 - 1, len(t.dims) + 1])  # a count that disagrees with the dims written
    else:
        t.dims = [1] * rng.randint(5, 9)
    return lay.build()


def _kv_with(layout: Layout, pred: Callable[[KV], bool]) -> list[KV]:
    return [k for k in layout.kvs if pred(k)]


def m_float_nonfinite(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    lay = layout.copy()
    floats = _kv_with(lay, lambda k: k.vtype in (F32, F64) or (k.vtype == ARR and struct.unpack_from("<I", k.raw)[0] == F32))
    keys = [f"{_arch(lay)}.{k}" for k in ("rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.factor",
                                            "rope.scaling.attn_factor")]
    if not floats or rng.random() < 0.3:
        lay.set(rng.choice(keys), rng.choice([F32, F64]), rng.choice(_NONFINITE))
        return lay.build()
    kv = rng.choice(floats)
    if kv.vtype == ARR:
        itype, items = kv.value()
        items = list(items)
        for _ in range(rng.randint(1, 4)):
            items[rng.randrange(len(items))] = rng.choice(_NONFINITE)
        kv.raw = gb.value(ARR, (itype, items))
    else:
        kv.raw = struct.pack(_FMT[kv.vtype], rng.choice(_NONFINITE))
    return lay.build()


def m_invalid_utf8(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    f = rng.choice(_strings(layout))
    bad = rng.choice(_BAD_UTF8)
    at = f.start + rng.randrange(f.size)
    buf = bytearray(base.prefix)
    n = min(len(bad), f.start + f.size - at)  # stay inside the string: its length field stays right
    buf[at : at + n] = bad[:n]
    return Sample(bytes(buf), base.size)


def _arch(lay: Layout) -> str:
    kv = lay.kv("general.architecture")
    return kv.value() if kv and kv.vtype == STR else "llama"


def m_metadata_value(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    lay = layout.copy()
    key = f"{_arch(lay)}.{rng.choice(_CONFIG_KEYS)}" if rng.random() < 0.6 else rng.choice(_OTHER_KEYS)
    vtype, value = _hostile_value(rng)
    lay.set(key, vtype, value)
    return lay.build()


def m_metadata_drop(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    lay = layout.copy()
    del lay.kvs[rng.randrange(len(lay.kvs))]
    return lay.build()


def m_tensor_drop(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    lay = layout.copy()
    if lay.tensors:
        del lay.tensors[rng.randrange(len(lay.tensors))]
    else:
        lay.tensors.append(Tensor(b"token_embd.weight", [32, 8], 0, 0))  # data the file does not have
    return lay.build()


def m_counts(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    """Magic, version and the two counts lying."""
    how = rng.randrange(5)
    if how == 0:
        return layout.build(n_kv=len(layout.kvs) + rng.choice([1, 2, -1, 1000, 2**32]))
    if how == 1:
        return layout.build(n_tensors=len(layout.tensors) + rng.choice([1, -1, 1000, 2**32]))
    if how == 2:
        return layout.build(version=rng.choice([0, 1, 4, 2**24 * 3, 0x03000000, 2**32 - 1]))
    if how == 3:
        return layout.build(magic=rng.choice([b"GGUG", b"\0\0\0\0", b"FUGG", b"GGML"]))
    return layout.build(n_kv=rng.choice([0, 2**64 - 1]), n_tensors=rng.choice([0, 2**63]))


def m_tokenizer_arrays(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    """Inconsistent vocabulary arrays: lengths that disagree, malformed merges, duplicate or empty tokens..."""
    lay = layout.copy()
    tok = lay.kv("tokenizer.ggml.tokens")
    if tok is None or tok.vtype != ARR:
        return m_metadata_value(rng, base, layout)
    _, tokens = tok.value()
    how = rng.randrange(12)
    if how == 11:  # a vocabulary of a few tokens, merges and special ids left as they were
        tok.raw = gb.value(ARR, (STR, list(tokens[: rng.choice([1, 2, 3, 10])])))
        if rng.random() < 0.5:
            lay.set("tokenizer.ggml.merges", ARR, (STR, [f"{tokens[0]} {tokens[-1]}", f"{tokens[0]} {tokens[0]}"]))
    elif how == 0:  # token_type shorter / longer
        n = len(tokens) + rng.choice([-1, -len(tokens), 5])
        lay.set("tokenizer.ggml.token_type", ARR, (I32, [rng.choice([1, 3, 6]) for _ in range(max(n, 0))]))
    elif how == 1:  # scores shorter, or of the wrong kind
        lay.set("tokenizer.ggml.scores", ARR, rng.choice([(F32, [0.0] * (len(tokens) // 2)), (STR, ["x"] * len(tokens)),
                                                         (F64, [1e300] * len(tokens)), (F32, [math.nan] * len(tokens))]))
    elif how == 2:  # token types out of range, non-integers
        lay.set("tokenizer.ggml.token_type", ARR, rng.choice([(I32, [rng.choice([-1, 0, 7, 2**31 - 1]) for _ in tokens]),
                                                             (F32, [math.nan] * len(tokens)), (STR, ["1"] * len(tokens)),
                                                             (F64, [math.inf] * len(tokens)), (BOOL, [True] * len(tokens))]))
    elif how == 3:  # malformed merges
        merges = rng.choice([["nospace"], [" leading"], ["a b c"], ["zz qq"], [""], ["Ġ t"] * 3, ["\u0100 \u0101"]])
        lay.set("tokenizer.ggml.merges", ARR, (STR, merges))
    elif how == 4:  # merges of the wrong type
        lay.set("tokenizer.ggml.merges", ARR, rng.choice([(U32, [1, 2]), (STR, []), (F32, [1.0])]))
    elif how == 5:  # duplicate token
        tokens = list(tokens)
        tokens[rng.randrange(len(tokens))] = tokens[rng.randrange(len(tokens))]
        tok.raw = gb.value(ARR, (STR, tokens))
    elif how == 6:  # empty tokens / empty vocabulary
        tokens = [] if rng.random() < 0.3 else ["" for _ in tokens]
        tok.raw = gb.value(ARR, (STR, tokens))
    elif how == 7:  # special ids out of range
        key = rng.choice(["bos", "eos", "unknown", "padding", "eot", "fim_pad", "eom"])
        lay.set(f"tokenizer.ggml.{key}_token_id", rng.choice([U32, I32, I64, U64]), rng.choice([len(tokens), 2**31 - 1, 0]))
    elif how == 8:  # everything a control token (a big special-token regex), or long tokens
        if rng.random() < 0.5:
            lay.set("tokenizer.ggml.token_type", ARR, (I32, [3] * len(tokens)))
        else:
            tokens = list(tokens)
            tokens[-1] = "x" * rng.choice([1000, 100000])
            tok.raw = gb.value(ARR, (STR, tokens))
    elif how == 9:  # tokens of the wrong item type
        tok.raw = gb.value(ARR, rng.choice([(U32, list(range(len(tokens)))), (F32, [0.5] * 4), (BOOL, [True])]))
    else:  # add_bos without a BOS, unknown tokenizer model / pre-tokenizer
        lay.set(rng.choice(["tokenizer.ggml.model", "tokenizer.ggml.pre"]), STR, rng.choice(["bert", "rwkv", "", "t5", "ugm", "smollm"]))
        lay.set("tokenizer.ggml.add_bos_token", BOOL, True)
    return lay.build()


def m_garbage(rng: random.Random, base: Sample, layout: Layout) -> Sample:
    n = rng.randint(0, 256)
    body = bytes(rng.randrange(256) for _ in range(n))
    if rng.random() < 0.7:
        body = b"GGUF" + struct.pack("<I", rng.choice([2, 3])) + body
    return Sample(body, len(body))


MUTATORS: dict[str, Callable[[random.Random, Sample, Layout], Sample]] = {
    "bit flips (header)": m_bitflip_header,
    "bit flips (anywhere)": m_bitflip_any,
    "random bytes": m_random_bytes,
    "inserted/deleted bytes": m_splice,
    "truncation at a boundary": m_truncate,
    "huge counts and lengths": m_huge_count,
    "wrong value/tensor types": m_wrong_type,
    "duplicate keys": m_duplicate_key,
    "duplicate tensor names": m_duplicate_tensor,
    "overlapping/misaligned offsets": m_tensor_offset,
    "bad dimensions": m_tensor_dims,
    "NaN/inf floats": m_float_nonfinite,
    "invalid UTF-8": m_invalid_utf8,
    "hostile metadata values": m_metadata_value,
    "missing keys": m_metadata_drop,
    "missing tensors": m_tensor_drop,
    "lying magic/version/counts": m_counts,
    "inconsistent vocabulary": m_tokenizer_arrays,
    "garbage": m_garbage,
}


def boundary_truncations(base: Sample, layout: Layout, limit: int | None = None) -> list[Sample]:
    """The file cut at the start of every field and one byte into it (the deterministic truncation set).
    With `limit`, about that many cuts, spread evenly over the file (the fixed header always included)."""
    cuts = sorted({c for f in layout.fields for c in (f.start, f.start + 1) if c < base.size} | {base.size - 1})
    if limit and len(cuts) > limit:
        head = [c for c in cuts if c < 24]  # magic, version, counts
        rest = [c for c in cuts if c >= 24]
        cuts = head + rest[:: -(-len(rest) // max(1, limit - len(head)))]
    return [Sample(base.prefix[:c], c) for c in cuts]
