"""components.model.gguf_header against the gguf package's own reader and writer: every
metadata value and tensor entry equal, on a written file with every value type and on the
default model; a file that is cut short or is not GGUF is a ValueError."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from components.model.gguf_header import read_header


def reference(path) -> tuple[dict, list]:
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, [int(x) for x in t.shape], int(t.tensor_type), int(t.data_offset))
               for t in r.tensors]
    return meta, tensors


def mine(path) -> tuple[dict, list]:
    h = read_header(path)
    return h.meta, [(t.name, t.dims, t.qtype, h.data_start + t.offset) for t in h.tensors]


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_string("t.str", "héllo ✓ <|im_end|>")
    w.add_array("t.strs", ["Ġthe", "", "ĊĊ", "日本"])
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.weight", np.ones((5,), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_and_tensor_entry_equals_the_gguf_reader(written):
    ref_meta, ref_tensors = reference(written)
    meta, tensors = mine(written)
    assert meta == ref_meta
    assert tensors == ref_tensors
    assert meta["t.strs"] == ["Ġthe", "", "ĊĊ", "日本"] and meta["t.u64"] == 2**63 + 5
    h = read_header(written)
    a = h.tensors[0]
    got = np.frombuffer(h.data, np.float32, count=12, offset=h.data_start + a.offset)
    assert got.tolist() == list(range(12))
    lean = read_header(written, string_arrays=False)     # the executor's read: no vocabulary
    assert lean.meta["t.strs"] is None and lean.tensors == h.tensors
    assert lean.data_start == h.data_start


def test_the_default_models_header_equals_the_gguf_reader(model_path):
    ref_meta, ref_tensors = reference(model_path)
    meta, tensors = mine(model_path)
    assert meta == ref_meta and tensors == ref_tensors
    assert len(meta["tokenizer.ggml.tokens"]) == 49152


def test_a_cut_or_foreign_file_is_a_value_error(written, tmp_path):
    data = written.read_bytes()
    header_end = read_header(written).data_start
    for n in (2, 10, 30, header_end // 2, header_end - 40):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n] + b"\0" * (4 - n) if n < 4 else data[:n])
        for strings in (True, False):       # the tokenizers' read, and the executor's
            with pytest.raises(ValueError):
                read_header(cut, string_arrays=strings)
    foreign = tmp_path / "x.gguf"
    foreign.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(foreign)
