"""Hostile bus frames, shared by the codec fuzz tests (tests/bus/test_fuzz_codec.py) and
the live fuzzer (scripts/reliability/fuzz_bus.py).

``FrameGen(rng).frame(union)`` makes the bytes of one frame for a socket that decodes
``union``:

- random bytes, and random msgpack values (untyped; nested, extreme numbers, odd keys);
- deep nesting (up to 100k levels) as the frame, the body, a field, an unknown field or an
  envelope slot;
- envelopes of the wrong shape, and bodies with the right tag but wrong field types;
- well-typed messages of the union with hostile values (``FrameGen.message``): integers at
  the msgpack limits (2^64-1, 2^63, -2^63), NaN/inf floats, empty and huge strings and
  lists, names of real tenants and components;
- truncations, byte flips and splices of encoded well-typed messages.

``rng`` is anything with the ``random.Random`` API: a seeded ``random.Random`` for bulk
runs (tens of microseconds a frame), or Hypothesis's ``st.randoms()`` for a run whose
failures Hypothesis shrinks and replays. Everything is derived from the schemas through
``msgspec.inspect``, so new fields and message types are fuzzed without touching this file.
"""
from __future__ import annotations

import random
import typing
from functools import cache

import msgspec
import msgspec.inspect as mi

from bus.codec import encode
from schemas.config import COMPONENTS

U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
EXTREME_INTS = (0, 1, -1, 2, 255, 256, 2**15, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1,
                2**63, U64_MAX, I64_MIN, I64_MIN + 1, -(2**31), -(2**32))
EXTREME_FLOATS = (0.0, -0.0, 1.0, -1.0, 1e-300, 5e-324, 1e308, -1e308, float("inf"),
                  float("-inf"), float("nan"), 2.0**63, 0.5)
NAMES = ("", "default", "acme", "r1", "fuzz", "0", " ", "\x00", "é", "\U0001f600", "a" * 300,
         *COMPONENTS, "supervisor", "gateway", "ready", "dead", "draining", "starting",
         "stop", "length", "alloc", "fork", "swap_out", "swap_in", "stored", "removed",
         "public:library", "user", "system", "assistant", "{{ raise_exception('x') }}")
TRACEPARENTS = (None, "", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "00-00000000000000000000000000000000-0000000000000000-00", "zz" * 40)
ALPHABET = "ab \u00e9\u4e2d\U0001f600\n\t\x00\x7f\ufffd"
DEPTHS = (64, 200, 1_000, 5_000, 100_000)
_SCALARS = (mi.IntType, mi.FloatType, mi.StrType, mi.BoolType, mi.NoneType)
_ENV_HEAD = b"\x94\x01\x01\xc0"          # an envelope [1, 1, nil, <body>]


def members(union) -> tuple[type, ...]:
    """The Struct types of a union (``Union[X]`` is just ``X``)."""
    args = typing.get_args(union)
    return args if args else (union,)


@cache
def _info(union) -> tuple[tuple[mi.StructType, ...], tuple[str, ...], tuple[str, ...]]:
    structs = tuple(mi.type_info(m) for m in members(union))
    tags = tuple(s.tag for s in structs if s.tag)
    fields = tuple(sorted({f.encode_name for s in structs for f in s.fields}))
    return structs, tags, fields


def deep(depth: int, inner: bytes = b"\xc0", map_: bool = False) -> bytes:
    """``depth`` nested one-element arrays (or one-key maps) around ``inner``."""
    return (b"\x81\xa1k" if map_ else b"\x91") * depth + inner


def pack(value) -> bytes:
    return msgspec.msgpack.encode(value)


class FrameGen:
    """Hostile frames and well-typed hostile messages from ``rng`` (see the module doc)."""

    KINDS = ("bytes", "untyped", "deep", "wrong_body", "typed", "typed", "typed", "mutated")

    def __init__(self, rng: random.Random, big: int = 2_000) -> None:
        self.r = rng
        self.big = big              # length of the "huge" strings, lists and maps

    # ------------------------------------------------------------ scalars
    def int_(self) -> int:
        r = self.r
        match r.randrange(4):
            case 0:
                return r.choice(EXTREME_INTS)
            case 1:
                return r.randint(-3, 64)
            case 2:
                return r.randint(0, 5000)
            case _:
                return r.randint(I64_MIN, U64_MAX)

    def float_(self) -> float:
        r = self.r
        return r.choice(EXTREME_FLOATS) if r.randrange(2) else r.uniform(-1e6, 1e6)

    def str_(self) -> str:
        r = self.r
        match r.randrange(8):
            case 0 | 1 | 2:
                return r.choice(NAMES)
            case 3:
                return r.choice(ALPHABET) * r.randint(self.big // 2, self.big)
            case _:
                return "".join(r.choice(ALPHABET) for _ in range(r.randrange(12)))

    def bytes_(self, max_size: int = 64) -> bytes:
        n = self.r.randrange(max_size + 1)
        return bytes(self.r.getrandbits(8) for _ in range(n))

    # ------------------------------------------------------------ typed values
    def value(self, t: mi.Type):
        """A well-typed but hostile value for a ``msgspec.inspect`` type."""
        r = self.r
        match t:
            case mi.IntType():
                return self.int_()
            case mi.FloatType():
                return self.float_()
            case mi.StrType():
                return self.str_()
            case mi.BoolType():
                return bool(r.randrange(2))
            case mi.NoneType():
                return None
            case mi.BytesType() | mi.ByteArrayType():
                return self.bytes_()
            case mi.LiteralType(values=values):
                return r.choice(values)
            case mi.UnionType(types=types):
                return self.value(r.choice(types))
            case mi.ListType(item_type=item):
                return self.seq(item)
            case mi.VarTupleType(item_type=item):
                return tuple(self.seq(item))
            case mi.TupleType(item_types=items):
                return tuple(self.value(x) for x in items)
            case mi.DictType(key_type=k, value_type=v):
                if r.randrange(6) == 0:
                    one = self.value(v)
                    n = r.randint(self.big // 2, self.big)     # keys of the declared type
                    return ({i: one for i in range(n)} if isinstance(k, mi.IntType)
                            else {f"k{i}": one for i in range(n)})
                return {self.value(k): self.value(v) for _ in range(r.randrange(5))}
            case mi.StructType(cls=cls, fields=fields):
                return self.struct(cls, fields)
            case mi.AnyType():
                return self.untyped()
        raise TypeError(f"no generator for {t!r}")

    def seq(self, item: mi.Type) -> list:
        """Empty, short or (scalar items only, so frames stay a few MB) huge."""
        r = self.r
        match r.randrange(6):
            case 0:
                return []
            case 1 if isinstance(item, _SCALARS):
                return [self.value(item)] * r.randint(self.big // 2, self.big)
            case _:
                return [self.value(item) for _ in range(r.randint(1, 6))]

    def struct(self, cls, fields):
        """``cls`` with hostile values in its required fields and some optional ones. A
        struct that checks its own values (a config section's ``__post_init__``, in a
        ``PolicyChange``) refuses most of them with a ValueError: it is drawn again, and
        after 8 tries from its required fields alone (the rest at their defaults)."""
        for attempt in range(32):
            try:
                kwargs = {f.name: self.value(f.type) for f in fields
                          if f.required or (attempt < 8 and self.r.randrange(2))}
                return cls(**kwargs)
            except ValueError:
                continue
        raise ValueError(f"no {cls.__name__} could be drawn that it accepts")

    def message(self, union):
        """A well-typed message of ``union`` with hostile values."""
        structs, _, _ = _info(union)
        s = self.r.choice(structs)
        return self.struct(s.cls, s.fields)

    def untyped(self, depth: int = 3):
        """An arbitrary msgpack value: what a peer with no schema could send."""
        r = self.r
        match r.randrange(9 if depth > 0 else 6):
            case 0:
                return None
            case 1:
                return bool(r.randrange(2))
            case 2:
                return self.int_()
            case 3:
                return self.float_()
            case 4:
                return self.str_()
            case 5:
                return self.bytes_(32)
            case 6 | 7:
                return [self.untyped(depth - 1) for _ in range(r.randrange(5))]
            case _:
                return {(self.str_() if r.randrange(3) else self.int_()): self.untyped(depth - 1)
                        for _ in range(r.randrange(5))}

    # ------------------------------------------------------------ frames
    def well_typed_frame(self, union) -> bytes:
        return encode(self.message(union), self.r.choice(TRACEPARENTS))

    def frame(self, union) -> bytes:
        """One hostile frame for a socket that decodes ``union``."""
        return getattr(self, "_" + self.r.choice(self.KINDS))(union)

    def _bytes(self, union) -> bytes:
        return self.bytes_()

    def _untyped(self, union) -> bytes:
        return pack(self.untyped())

    def _typed(self, union) -> bytes:
        return self.well_typed_frame(union)

    def _deep(self, union) -> bytes:
        r = self.r
        _, tags, fields = _info(union)
        nest = deep(r.choice(DEPTHS), map_=bool(r.randrange(2)))
        match r.randrange(4):
            case 0:
                return nest
            case 1:
                return _ENV_HEAD + nest
            case 2:
                return b"\x94" + nest + b"\x01\xc0\x80"
            case _:       # a map body {type: tag, <field or unknown>: <deep>}
                tag = r.choice(tags) if tags else "x"
                field = r.choice((*fields, "request_id", "unknown"))
                return _ENV_HEAD + b"\x82" + pack({"type": tag})[1:] + pack(field) + nest

    def _wrong_body(self, union) -> bytes:
        """The right tag, fields of arbitrary (mostly wrong) types, maybe unknown fields."""
        r = self.r
        _, tags, fields = _info(union)
        body = {name: self.untyped(2) for name in r.sample(fields, r.randint(0, len(fields)))}
        if r.randrange(2):
            body[self.str_()] = self.untyped(2)
        body["type"] = r.choice(tags) if tags and r.randrange(4) else self.str_()
        env = [self.untyped(1), self.int_(), r.choice(TRACEPARENTS), body]
        match r.randrange(12):
            case 0:
                env = env[:3]
            case 1:
                env = [*env, 1]
            case 2:
                return pack(body)
        return pack(env)

    def _mutated(self, union) -> bytes:
        r = self.r
        data = bytearray(self.well_typed_frame(union))
        match r.randrange(4):
            case 0:
                return bytes(data[:r.randrange(len(data))])
            case 1:
                for _ in range(r.randint(1, 4)):
                    data[r.randrange(len(data))] = r.getrandbits(8)
                return bytes(data)
            case 2:
                i = r.randrange(len(data) + 1)
                return bytes(data[:i]) + self.bytes_(16) + bytes(data[i:])
            case _:
                return bytes(data) + self.bytes_(8)
