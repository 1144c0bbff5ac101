"""fusectl.io.pickle_scan: the scan of a pickle before it is unpickled, family by family.

Each opcode family of the scan's table is run here on its own: ``step`` runs one opcode on a
stack set up by hand and returns the machine, so a test sees exactly what the opcode pushed,
counted and refused. ``scan`` is run on whole pickles written by ``pickle.dumps`` (plain Python
objects, every protocol) and on crafted opcodes. Whole torch.save files are tested in
test_torch_reader.py, test_hostile_readers.py and test_pickle_amplification.py.
"""

from __future__ import annotations

import pickle
import pickletools
import re
import struct
from collections import OrderedDict

import pytest

from fusectl.errors import CheckpointError
from fusectl.io import pickle_scan as ps
from fusectl.io.pickle_scan import Builds, NeedMore, call_bytes, scan

ALLOWED = {"builtins.set": Builds.SET, "builtins.frozenset": Builds.FROZENSET, "torch.Size": Builds.TUPLE,
           "collections.OrderedDict": Builds.DICT, "_codecs.encode": Builds.BYTES,
           "builtins.complex": Builds.OBJECT, "builtins.bytearray": Builds.BYTES}
ALLOWED.update({"__builtin__." + k[len("builtins."):]: v for k, v in ALLOWED.items() if k.startswith("builtins.")})
ALLOWED["__builtin__.bytes"] = Builds.BYTES  # protocols 1 and 2 write bytes as a call


def machine(data: bytes, stack=(), marks=(), complete: bool = True, allowed=None) -> ps._Scanner:
    m = ps._Scanner(data, 0, "m.pt", complete, ALLOWED if allowed is None else allowed, 0)
    m.stack.extend(stack)
    m.marks.extend(marks)
    m.fence = m.marks[-1] if m.marks else 0
    return m


def step(data: bytes, stack=(), marks=(), complete: bool = True, allowed=None, count: int = 1) -> ps._Scanner:
    """The machine after its table ran the first ``count`` opcodes of ``data`` on ``stack``."""
    m = machine(data, stack, marks, complete, allowed)
    for _ in range(count):
        op = m.data[m.pos]
        m.pos += 1
        m.ops += 1
        assert not ps._TABLE[op](m, op)
    return m


def refused(data: bytes, needle: str, stack=(), marks=(), complete: bool = True, allowed=None) -> str:
    with pytest.raises(CheckpointError) as e:
        step(data, stack, marks, complete, allowed)
    message = str(e.value)
    assert message.startswith("m.pt") and needle in message, message
    return message


def scan_refused(data: bytes, needle: str, allowed=None) -> str:
    with pytest.raises(CheckpointError) as e:
        scan(data, 0, "m.pt", True, ALLOWED if allowed is None else allowed)
    message = str(e.value)
    assert message.startswith("m.pt") and needle in message, message
    return message


def top(m: ps._Scanner):
    assert len(m.stack) >= 1
    return m.stack[-1]


# ------------------------------------------------------------------------------ the table
FAMILIES = {
    ps._Numbers: {"NONE", "NEWTRUE", "NEWFALSE", "BININT1", "BININT2", "BININT", "BINFLOAT", "LONG1", "LONG4",
                  "INT", "LONG", "FLOAT"},
    ps._Strings: {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
                  "BINSTRING", "SHORT_BINSTRING", "BYTEARRAY8", "STRING", "UNICODE"},
    ps._Containers: {"EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "TUPLE", "FROZENSET", "EMPTY_DICT", "EMPTY_LIST",
                     "EMPTY_SET", "LIST", "DICT", "APPENDS", "SETITEMS", "ADDITEMS", "APPEND", "SETITEM"},
    ps._Memo: {"BINPUT", "LONG_BINPUT", "MEMOIZE", "PUT", "BINGET", "LONG_BINGET", "GET"},
    ps._Stack: {"MARK", "POP", "POP_MARK", "DUP"},
    ps._Calls: {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "NEWOBJ", "BINPERSID", "PERSID"},
    ps._Framing: {"PROTO", "FRAME", "STOP"},
    ps._Refused: {"INST", "OBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"},
}


def claimed(family) -> list[str]:
    return [name for method in vars(family).values() for name in getattr(method, "opcodes", ())]


def test_every_opcode_has_exactly_one_family():
    assert set(FAMILIES) == set(ps._FAMILIES)
    names = [name for family in ps._FAMILIES for name in claimed(family)]
    assert sorted(names) == sorted(op.name for op in pickletools.opcodes)  # each once, none missing
    for family, expected in FAMILIES.items():
        assert set(claimed(family)) == expected, family.__name__


def test_the_table_runs_each_opcode_with_its_familys_handler():
    for family in ps._FAMILIES:
        for method in vars(family).values():
            for name in getattr(method, "opcodes", ()):
                assert ps._TABLE[ps._CODES[name]] is method, name
    codes = {ord(op.code) for op in pickletools.opcodes}
    assert all(ps._TABLE[b] is ps._Machine.unknown for b in range(256) if b not in codes)


@pytest.mark.parametrize("byte", [0x00, 0x01, 0x7F, 0x99, 0xFF])
def test_a_byte_no_family_claims_is_an_unknown_opcode(byte):
    assert refused(bytes([byte]), f"corrupt pickle: unknown opcode 0x{byte:02x} at byte 1")
    scan_refused(b"\x80\x02N" + bytes([byte]), f"unknown opcode 0x{byte:02x} at byte 4")


# ------------------------------------------------------------------------------ whole pickles of plain objects
PLAIN = [None, True, False, 0, 255, 65535, -1, 2**31, 2**62, -(2**70), 1.5, "", "name", "é" * 5, "x" * 5000,
         b"", b"raw" * 100, (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), ("a", ("b",)), [], [1, [2, [3]]],
         {}, {"a": 1, "b": [None]}, {1, 2}, frozenset({"a"}), OrderedDict(w=(2, 3)), complex(1, 2), bytearray(b"ab"),
         [("shared",)] * 3]


@pytest.mark.parametrize("protocol", range(1, pickle.HIGHEST_PROTOCOL + 1))
def test_plain_objects_of_every_protocol_scan_to_their_end(protocol):
    for value in PLAIN:
        data = pickle.dumps(value, protocol=protocol)
        assert scan(data, 0, "m.pt", True, ALLOWED)[0] == len(data), value


def test_protocol_0_pickles_scan_too():
    data = pickle.dumps([1, "a", (2.5, None), {"k": -3}], protocol=0)
    assert scan(data, 0, "m.pt", True, {})[0] == len(data)


def test_scan_starts_at_pos_and_returns_where_the_pickle_ends():
    first, second = pickle.dumps("a", protocol=2), pickle.dumps([1, 2], protocol=2)
    data = first + second
    end, memory = scan(data, 0, "m.pt", True, {})
    assert end == len(first)
    end2, memory2 = scan(data, end, "m.pt", True, {}, memory=memory)
    assert end2 == len(data) and memory2 > memory
    # refusals count bytes from where the pickle starts
    with pytest.raises(CheckpointError, match="unknown opcode 0xff at byte 4;"):
        scan(b"junk\x80\x02N\xff", 4, "m.pt", True, {})


def test_bytes_that_end_before_stop_need_more_or_are_truncated():
    data = pickle.dumps([1, 2, 3], protocol=2)[:-1]
    with pytest.raises(NeedMore):
        scan(data, 0, "m.pt", False, {})
    scan_refused(data, f"the pickle ends at byte {len(data)} before its STOP opcode; the file is truncated")


# ------------------------------------------------------------------------------ numbers and constants
@pytest.mark.parametrize("data, pushed", [
    (b"N", None), (b"\x88", None), (b"\x89", None), (b"K\x05", None), (b"M\x05\x01", None),
    (b"J\x05\x00\x00\x00", None), (b"G" + struct.pack(">d", 1.5), ps._COLLIDABLE),
])
def test_fixed_numbers_push_and_move_past_their_argument(data, pushed):
    m = step(data)
    assert m.stack == [pushed] and m.pos == len(data)


def test_new_numbers_are_charged_and_shared_constants_are_not():
    """None, True, False and BININT1's 0..255 are shared objects; BININT2, BININT and BINFLOAT
    each make a new one (before, the charges were the wrong way round for all but BININT1/2)."""
    charged = {data: step(data).memory for data in (b"N", b"\x88", b"K\x05", b"M\x05\x01", b"J\0\0\0\0", b"G" + bytes(8))}
    assert charged == {b"N": 0, b"\x88": 0, b"K\x05": 0, b"M\x05\x01": ps._NUMBER,
                       b"J\0\0\0\0": ps._NUMBER, b"G" + bytes(8): ps._NUMBER}


@pytest.mark.parametrize("data", [b"K", b"M\x01", b"J\x01\x02", b"G\x00"])
def test_a_number_cut_short_is_truncated(data):
    refused(data, "before its STOP opcode; the file is truncated")
    with pytest.raises(NeedMore):
        step(data, complete=False)


def test_binary_longs():
    assert step(b"\x8a\x02\x01\x02").stack == [None]  # small: hashes to itself
    assert step(b"\x8a\x08" + bytes(8)).stack == [ps._COLLIDABLE]  # big: a hash the file can choose
    assert step(b"\x8a\x02\x01\x02").memory == ps._NUMBER + 2
    # 13 bytes may hold more than 30 digits: counted when they do, accepted when they don't
    assert step(b"\x8a\x0d\x01" + bytes(12)).stack == [ps._COLLIDABLE]
    refused(b"\x8a\x0d" + b"\xff" * 12 + b"\x7f", "an integer of 13 bytes: 32 digits in one integer exceeds")
    refused(b"\x8b\xff\xff\xff\xff", "corrupt pickle: a negative length at byte 5")
    refused(b"\x8a\x05\x01", "the file is truncated")


def test_text_numbers():
    assert step(b"I123\n").stack == [None]
    assert step(b"L123L\n").stack == [None]
    assert step(b"I" + b"9" * 18 + b"\n").stack == [ps._COLLIDABLE]
    assert step(b"F1.5\n").stack == [ps._COLLIDABLE]
    assert step(b"I-12\n").memory == ps._NUMBER + 2
    refused(b"I" + b"1" * 31 + b"\n", "an integer: 31 digits in one integer exceeds fusectl's limit of 30")
    refused(b"L-" + b"1" * 31 + b"L\n", "an integer: 31 digits")
    assert step(b"F" + b"1" * 40 + b"\n").stack == [ps._COLLIDABLE]  # a float's digits are not an integer's
    refused(b"I12", "the file is truncated")


def test_integer_digits_follow_their_budget(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_INTEGER_DIGITS", "40")
    assert step(b"I" + b"1" * 31 + b"\n").stack == [ps._COLLIDABLE]


# ------------------------------------------------------------------------------ strings and bytes
def counted(op: bytes, fmt: str, raw: bytes) -> bytes:
    return op + struct.pack(fmt, len(raw)) + raw


@pytest.mark.parametrize("op, fmt", [(b"X", "<I"), (b"\x8c", "<B"), (b"\x8d", "<Q")])
def test_short_text_is_pushed_as_itself(op, fmt):
    m = step(counted(op, fmt, "tórch".encode()))
    assert m.stack == ["tórch"] and m.pos == len(counted(op, fmt, "tórch".encode()))


def test_long_text_is_pushed_as_its_length():
    m = step(counted(b"X", "<I", b"a" * 1025))
    assert top(m).__class__ is ps._Blob and top(m).n == 1025
    assert m.memory == ps._STR + 4 * 1025
    assert step(counted(b"X", "<I", b"a" * 1024)).stack == ["a" * 1024]


@pytest.mark.parametrize("op, fmt", [(b"B", "<I"), (b"C", "<B"), (b"\x8e", "<Q"), (b"T", "<i"), (b"U", "<B"),
                                     (b"\x96", "<Q")])
def test_bytes_are_pushed_as_their_length(op, fmt):
    m = step(counted(op, fmt, b"os"))
    assert top(m).__class__ is ps._Blob and top(m).n == 2  # bytes never name a global
    assert m.memory == ps._BYTES + 2


def test_string_refusals():
    refused(b"X\x02\x00\x00\x00\xff\xfe", "corrupt pickle: a string that is not UTF-8 at byte 5")
    refused(b"T\xff\xff\xff\xff", "corrupt pickle: a negative length at byte 5")
    refused(b"X\x09\x00\x00\x00abc", "corrupt pickle: a string of 9 bytes past the end of the pickle")
    with pytest.raises(NeedMore):
        step(b"X\x09\x00\x00\x00abc", complete=False)
    refused(b"X\x09\x00", "the file is truncated")


def test_long_strings_are_counted_against_the_memory_budget(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_MEMORY", "1000")
    refused(counted(b"X", "<I", b"a" * 2000), "8080 bytes of objects")
    refused(counted(b"B", "<I", b"a" * 2000), "2048 bytes of objects")


def test_text_strings_are_their_line():
    m = step(b"S'os'\n")
    assert top(m).__class__ is ps._Blob and top(m).n == 4 and m.memory == ps._STR + 16
    assert top(step(b"Vsystem\n")).n == 6
    refused(b"Vsystem", "the file is truncated")


# ------------------------------------------------------------------------------ containers
def test_small_tuples_of_plain_items_are_shared():
    for n in (1, 2, 3):
        m = step(bytes([0x84 + n]), stack=[None] * n)
        assert m.stack == [ps._FLAT[n]] and m.memory == ps._TUPLE + ps._TUPLE_ITEM * n
    assert step(b")").stack == [ps._FLAT[0]]


def test_small_tuples_of_sized_items_keep_their_size():
    m = step(b"\x86", stack=["name", None])
    t = top(m)
    assert t.__class__ is ps._Frozen and (t.d, t.w, t.n, t.first) == (1, 3, 2, 4)
    inner = ps._Frozen(1, 3, 2)
    t = top(step(b"\x85", stack=[inner]))
    assert (t.d, t.w, t.n) == (2, 4, 1)


def test_tuple_and_frozenset_take_the_items_above_the_mark():
    m = step(b"t", stack=[None, "a", None], marks=[1])
    t = top(m)
    assert m.stack[0] is None and (t.n, t.first, t.w) == (2, 1, 3) and not m.marks and m.fence == 0
    m = step(b"\x91", stack=[1, 2, 3], marks=[0])
    assert top(m).n == 3 and m.memory == ps._SET + 3 * ps._SET_ITEM


def test_container_refusals():
    refused(b"\x86", "corrupt pickle: TUPLE with too few items at byte 1", stack=[None, None], marks=[1])
    refused(b"t", "an opcode that needs a MARK without one")
    refused(b"l", "an opcode that needs a MARK without one", stack=[None])
    refused(b"e", "items added to nothing", stack=[None], marks=[0])
    refused(b"a", "APPEND with too few items", stack=[None])
    refused(b"s", "SETITEM with too few items", stack=[None, None])


@pytest.mark.parametrize("data, charge", [(b"}", ps._DICT), (b"]", ps._LIST), (b"\x8f", ps._SET)])
def test_empty_containers(data, charge):
    m = step(data)
    box = top(m)
    assert box.__class__ is ps._Box and (box.n, box.d) == (0, 1) and m.memory == charge


def test_list_and_dict_count_items_and_nesting():
    inner = ps._Box(3, 2)
    m = step(b"l", stack=[None, inner], marks=[0])
    assert (top(m).n, top(m).d) == (2, 3) and m.memory == ps._LIST + 2 * ps._LIST_ITEM
    m = step(b"d", stack=["a", None, "b", inner], marks=[0])
    assert (top(m).n, top(m).d) == (2, 3) and m.memory == ps._DICT + 2 * ps._DICT_ITEM


def test_items_added_grow_the_container():
    box = ps._Box(0, 1)
    step(b"e", stack=[box, None, ps._Box(0, 4)], marks=[1])
    assert (box.n, box.d) == (2, 5)
    step(b"u", stack=[box, "k", None, "j", None], marks=[1])
    assert box.n == 4
    step(b"\x90", stack=[box, 1, 2, 3], marks=[1])
    assert box.n == 7
    step(b"a", stack=[box, None])
    step(b"s", stack=[box, "k", None])
    assert box.n == 9
    frozen = ps._Frozen(1, 1, 0)
    step(b"a", stack=[frozen, None])  # not a list: the unpickler refuses it, the scan counts nothing
    assert frozen.n == 0


def test_items_budget(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_ITEMS", "3")
    refused(b"l", "4 items in one pickled list, dict, tuple or set exceeds", stack=[None] * 4, marks=[0])
    refused(b"e", "4 items in one pickled", stack=[ps._Box(3, 1), None], marks=[1])


def test_depth_budget(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_DEPTH", "3")
    assert top(step(b"\x85", stack=[ps._Frozen(2, 1, 0)])).d == 3
    refused(b"\x85", "4 levels of nesting", stack=[ps._Frozen(3, 1, 0)])
    refused(b"l", "4 levels of nesting", stack=[ps._Box(0, 3)], marks=[0])


def test_hash_keys_budget(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_HASH_KEYS", "2")
    step(b"d", stack=["a", None, ps._Blob(3), None, None, None, "b", None], marks=[0])  # strings, bytes, None: safe
    refused(b"d", "3 dict keys or set members", stack=[ps._COLLIDABLE, None] * 3, marks=[0])
    refused(b"\x91", "5 dict keys", stack=[ps._Frozen(1, 5, 4)], marks=[0])  # a tuple key weighs its items
    refused(b"s", "3 dict keys", stack=[ps._Box(0, 1), ps._Frozen(1, 3, 2), None])


# ------------------------------------------------------------------------------ the memo
def test_put_and_get():
    m = step(b"q\x00", stack=["torch"])
    assert m.memo == ["torch"] and m.pos == 2 and m.memory == ps._MEMO_SLOT
    m = step(b"q\x00h\x00", stack=["torch"], count=2)
    assert m.stack == ["torch", "torch"] and m.pos == 4


def test_long_put_sizes_the_memo_by_its_index():
    m = step(b"NNNNr\x04\x00\x00\x00", count=5)
    assert m.memo == [ps._UNSET] * 4 + [None] and m.memory == 5 * ps._MEMO_SLOT  # None is shared: no charge
    m = machine(b"r\x03\x00\x00\x00", stack=[None])
    m.pos, m.ops = 1, 5
    ps._TABLE[ord("r")](m, ord("r"))
    assert m.memo == [ps._UNSET] * 3 + [None] and m.memory == 4 * ps._MEMO_SLOT


def test_memoize_and_text_put_get():
    m = step(b"\x94", stack=[None])
    assert m.memo == [None]
    m = step(b"p0\ng0\n", stack=["a"], count=2)
    assert m.memo == ["a"] and m.stack == ["a", "a"] and m.pos == 6


def test_memo_refusals():
    refused(b"r\x00\x00\x01\x00", "corrupt pickle: memo index 65536 (only 1 opcodes so far) at byte 5", stack=[None])
    refused(b"q\x00", "corrupt pickle: PUT with an empty stack at byte 1")
    refused(b"q\x00", "PUT with an empty stack", stack=[None], marks=[1])  # a MARK fences what lies below
    refused(b"h\x02", "corrupt pickle: memo entry 2 read before it was written at byte 1")
    refused(b"j\x07\x00\x00\x00", "memo entry 7 read before it was written at byte 1")
    refused(b"pX\n", "a memo index that is not a small number", stack=[None])
    refused(b"g" + b"1" * 31 + b"\n", "a memo index that is not a small number")
    refused(b"q", "the file is truncated", stack=[None])
    refused(b"j\x00\x00", "the file is truncated")


def test_memo_slots_count_against_the_memory_budget(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_MEMORY", "100")
    m = machine(b"r\x10\x00\x00\x00", stack=[None])
    m.pos, m.ops = 1, 100
    with pytest.raises(CheckpointError, match=re.escape("m.pt, by byte 5: 272 bytes of objects")):
        ps._TABLE[ord("r")](m, ord("r"))


# ------------------------------------------------------------------------------ marks and the stack
def test_mark_fences_the_stack():
    m = step(b"(", stack=[None, None])
    assert m.marks == [2] and m.fence == 2


def test_pop_takes_an_item_or_else_a_mark():
    m = step(b"0", stack=[None, "a"])
    assert m.stack == [None]
    m = step(b"0", stack=[None, None], marks=[1, 2])
    assert m.stack == [None, None] and m.marks == [1] and m.fence == 1
    m = step(b"0", stack=[None], marks=[1])
    assert m.marks == [] and m.fence == 0
    refused(b"0", "corrupt pickle: POP with an empty stack at byte 1")


def test_pop_mark_and_dup():
    m = step(b"1", stack=[None, "a", "b"], marks=[1])
    assert m.stack == [None] and not m.marks
    refused(b"1", "an opcode that needs a MARK without one", stack=[None])
    assert step(b"2", stack=["a"]).stack == ["a", "a"]
    refused(b"2", "corrupt pickle: DUP with an empty stack at byte 1", stack=["a"], marks=[1])


def test_items_waiting_on_the_stack_are_checked_now_and_then(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_ITEMS", "100")
    data = b"\x80\x02" + b"N" * 70000 + b"."
    scan_refused(data, "m.pt (items waiting on the pickle stack): 65534 items")


# ------------------------------------------------------------------------------ globals, calls, persistent ids
def test_allowed_globals_are_pushed_with_what_a_call_builds():
    ref = top(step(b"ctorch\nSize\n"))
    assert ref.__class__ is ps._GlobalRef and (ref.builds, ref.name) == (Builds.TUPLE, "torch.Size")
    m = step(b"\x93", stack=["collections", "OrderedDict"])
    assert top(m).builds is Builds.DICT and len(m.stack) == 1 and m.memory == ps._GLOBAL


def test_a_global_outside_the_allow_list_is_refused():
    message = refused(b"cos\nsystem\n", "the pickle calls 'os.system', which fusectl refuses")
    assert "torch.save(model.state_dict(), ...)" in message
    refused(b"\x93", "the pickle calls 'os.system'", stack=["os", "system"])
    refused(b"\x93", "corrupt pickle: STACK_GLOBAL without two strings", stack=[ps._Blob(2), "system"])
    refused(b"\x93", "STACK_GLOBAL with too few items", stack=["system"])
    refused(b"ctorch\nSize\n", "the pickle calls 'torch.Size'", allowed={})
    refused(b"cos\nsys", "the file is truncated")


def test_stack_global_through_the_memo():
    data = b"\x80\x04\x8c\x02os\x940\x8c\x06system\x940h\x00h\x01\x93)R."
    scan_refused(data, "the pickle calls 'os.system'")


@pytest.mark.parametrize("builds, pushed", [(Builds.TUPLE, ps._Frozen), (Builds.FROZENSET, ps._Frozen),
                                            (Builds.SET, ps._Box), (Builds.DICT, ps._Box), (Builds.BYTES, ps._Blob)])
def test_a_call_is_sized_from_its_first_argument(builds, pushed):
    args = ps._Frozen(2, 3, 1, 1000)  # one argument of 1000 items
    m = step(b"R", stack=[ps._GlobalRef(builds, "f"), args])
    assert len(m.stack) == 1 and top(m).__class__ is pushed and top(m).n == 1000
    assert m.memory == call_bytes(builds, 1000)


def test_a_call_of_fixed_size():
    args = ps._Frozen(2, 3, 2)
    m = step(b"R", stack=[ps._GlobalRef(Builds.OBJECT, "torch._utils._rebuild_tensor_v2"), args])
    assert m.stack == [args] and m.memory == ps._CALL  # nests no deeper than its arguments
    assert step(b"R", stack=[None, None]).stack == [ps._COLLIDABLE]


def test_call_refusals(monkeypatch):
    refused(b"R", "corrupt pickle: REDUCE with too few items at byte 1", stack=[None])
    refused(b"R", "REDUCE with too few items", stack=[None, None], marks=[1])
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_MEMORY", "10000")
    refused(b"R", "m.pt, by byte 1 (a call of 'torch.Size'): 80056 bytes of objects",
            stack=[ps._GlobalRef(Builds.TUPLE, "torch.Size"), ps._Frozen(2, 3, 1, 10000)])


def test_build_and_persistent_ids():
    assert step(b"b", stack=["obj", "state"]).stack == ["obj"]
    refused(b"b", "BUILD with too few items", stack=["obj"])
    m = step(b"Q", stack=[ps._Frozen(1, 6, 5)])
    assert m.stack == [None] and m.memory == ps._CALL
    refused(b"Q", "corrupt pickle: BINPERSID with an empty stack at byte 1")
    assert step(b"P0\n").stack == [None]


def test_memoized_calls_are_counted_each_time(monkeypatch):
    """A memoized list of a million items, copied 400 times by torch.Size: refused before it is built."""
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_ITEMS", str(10**6))
    million = b"(" + b"N" * 10**6 + b"l"
    data = (b"\x80\x02(" + million + b"r\x00\x00\x00\x00" + b"0" + b"ctorch\nSize\n" + b"r\x01\x00\x00\x00" + b"0"
            + (b"j\x01\x00\x00\x00" + b"j\x00\x00\x00\x00\x85R") * 400 + b"l.")
    message = scan_refused(data, "(a call of 'torch.Size')")
    assert "bytes of objects that unpickling a PyTorch checkpoint would build" in message


# ------------------------------------------------------------------------------ framing, protocol, stop
def test_proto():
    assert step(b"\x80\x05").pos == 2
    refused(b"\x80\x06", "corrupt pickle: pickle protocol 6 at byte 1")
    refused(b"\x80", "the file is truncated")


def test_frame():
    m = step(b"\x95" + struct.pack("<Q", 3) + b"N.N")
    assert m.pos == 9 and m.memory == ps._BYTES + 3 and not m.stack
    refused(b"\x95" + struct.pack("<Q", 30) + b"N.", "corrupt pickle: a frame of 30 bytes past the end of the pickle")
    m = step(b"\x95" + struct.pack("<Q", 30) + b"N.", complete=False)  # the rest may follow
    assert m.memory == ps._BYTES + 2
    refused(b"\x95\x01\x00", "the file is truncated")


def test_stop():
    m = machine(b".", stack=[None])
    m.pos = m.ops = 1
    assert ps._TABLE[ord(".")](m, ord(".")) is True
    for stack, marks in (([], []), ([None, None], []), ([None], [1])):
        m = machine(b".", stack=stack, marks=marks)
        m.pos = m.ops = 1
        with pytest.raises(CheckpointError, match="STOP with a stack that does not hold exactly one object"):
            ps._TABLE[ord(".")](m, ord("."))


def test_opcodes_budget(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_OPCODES", "10")
    data = pickle.dumps(list(range(20)), protocol=2)
    scan_refused(data, "pickle opcodes in one PyTorch checkpoint exceeds fusectl's limit of 10")
    assert scan(pickle.dumps([1], protocol=2), 0, "m.pt", True, {})[0] > 0


def test_memory_is_checked_at_stop(monkeypatch):
    data = pickle.dumps([None] * 100, protocol=2)
    end, memory = scan(data, 0, "m.pt", True, {})
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_MEMORY", str(memory - 1))
    scan_refused(data, f"m.pt, by byte {len(data)}: {memory} bytes of objects")
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_MEMORY", str(memory + 999))
    with pytest.raises(CheckpointError, match=f"{memory + 1000} bytes of objects"):
        scan(data, 0, "m.pt", True, {}, memory=1000)  # earlier pickles of the file count too


# ------------------------------------------------------------------------------ refused opcodes
@pytest.mark.parametrize("data, name", [(b"i", "INST"), (b"o", "OBJ"), (b"\x81", "NEWOBJ"), (b"\x92", "NEWOBJ_EX"),
                                        (b"\x82\x01", "EXT1"), (b"\x83\x01\x00", "EXT2"),
                                        (b"\x84\x01\x00\x00\x00", "EXT4"), (b"\x97", "NEXT_BUFFER"),
                                        (b"\x98", "READONLY_BUFFER")])
def test_object_building_opcodes_are_refused(data, name):
    message = refused(data, f"the pickle uses opcode {name} (at byte 0), which builds arbitrary objects")
    assert "fusectl runs no code from a checkpoint" in message
    scan_refused(b"\x80\x04N" + data + b".", f"opcode {name} (at byte 3)")
