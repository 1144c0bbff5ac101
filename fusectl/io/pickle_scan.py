"""A pickle checked opcode by opcode before anything is unpickled (``io.torch_file``'s first step).

The scan is a small symbolic run of the pickle machine: it constructs nothing, follows
``STACK_GLOBAL`` names through the memo, refuses a global outside the caller's allow-list and
every opcode that would build arbitrary objects or read outside the pickle, and bounds the work
the pickle asks for (``pickle-bytes``, ``pickle-opcodes``, ``pickle-items``, ``pickle-depth``,
``pickle-hash-keys``, ``integer-digits``) before the real unpickler does it.

It also adds up the memory the unpickler will allocate (``pickle-memory``): every object an
opcode makes and every result of an allowed call, sized from what the call is given. The memo
lets a few bytes name a large object again and again, and a call copies what it is given (a
2 MB pickle can call ``torch.Size`` 400 times on one memoized list of a million numbers:
gigabytes), so the results are counted, not the opcodes.
"""

from __future__ import annotations

import enum
import math
import pickle
import struct
import sys
from collections.abc import Mapping

from ..errors import CheckpointError, quote
from ..limits import check_limit, limit


class NeedMore(Exception):
    """The scan ran off the end of the bytes read so far (legacy files are read in chunks)."""


class Builds(enum.Enum):
    """What a call of an allowed global makes of its first argument (the scan counts it)."""

    OBJECT = "an object of a fixed size"  # a tensor description, a complex number
    TUPLE = "a tuple of its items"  # torch.Size
    SET = "a set of its items"  # builtins.set (more may be added: ADDITEMS)
    FROZENSET = "a frozenset of its items"
    DICT = "a dict of its pairs"  # collections.OrderedDict (more may be added: SETITEMS)
    BYTES = "bytes of its text"  # _codecs.encode


# Bytes the unpickler allocates per object (CPython 3.11, 64-bit, measured with tracemalloc and
# rounded up; a list's, dict's or set's growth included). A call of fixed size is charged for the
# tensor description and for what fusectl later makes of a tensor (spec, byte range, identity).
_NUMBER = 32
_STR = 80  # plus the characters: up to 4 bytes each (one emoji widens every character of a string)
_BYTES = 48
_TUPLE, _TUPLE_ITEM = 56, 8
_LIST, _LIST_ITEM = 72, 16
_DICT, _DICT_ITEM = 80, 80
_SET, _SET_ITEM = 232, 64
_CALL = 512
_GLOBAL = 128  # a stand-in the loader may make for each GLOBAL opcode
_MEMO_SLOT = 16  # the C unpickler's memo is an array that doubles past its largest index


# opcodes a state dict never needs that would build arbitrary objects, or read outside the pickle
_REFUSED_OPCODES = {
    ord("i"): "INST", ord("o"): "OBJ", 0x81: "NEWOBJ", 0x92: "NEWOBJ_EX",
    0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER",
}
# opcodes that push one scalar and take a fixed-size argument: byte → argument bytes
_SCALAR_FIXED = {ord("N"): 0, 0x88: 0, 0x89: 0, ord("K"): 1, ord("M"): 2, ord("J"): 4, ord("G"): 8}
# opcodes that push a string or bytes of counted length: byte → (length bytes, struct format, is text)
_COUNTED = {
    ord("X"): (4, "<I", True), 0x8C: (1, "<B", True), 0x8D: (8, "<Q", True),
    ord("B"): (4, "<I", False), ord("C"): (1, "<B", False), 0x8E: (8, "<Q", False),
    ord("T"): (4, "<i", False), ord("U"): (1, "<B", False), 0x96: (8, "<Q", False),
}
_LINE_SCALARS = {ord("I"), ord("L"), ord("F"), ord("S"), ord("V")}
_LONG_TEXT = 1 << 10  # strings longer than this never name a global


class _Box:
    """A list, dict or set the pickle builds: the scan counts its items and its nesting."""

    __slots__ = ("n", "d")

    def __init__(self, n: int, d: int):
        self.n, self.d = n, d


class _Frozen:
    """A tuple or frozenset the pickle builds (or what a call makes of one). Hashing one
    recurses in C without a depth guard, so its nesting ``d`` is bounded; and it visits every
    item of every inner tuple each time (tuples keep no hash), so its weight ``w`` (items
    counted as often as they occur: a tuple may hold one inner tuple six times, at each of 60
    levels) is what it costs as a dict key. ``n`` is its item count and ``first`` the size of
    its first item (``_extent``): what a call given this tuple as its arguments copies."""

    __slots__ = ("d", "w", "n", "first")

    def __init__(self, d: int, w: int, n: int, first: int = 0):
        self.d, self.w, self.n, self.first = d, w, n, first


class _Blob:
    """A string or bytes too long to name a global: only its length ``n`` is kept."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n


class _GlobalRef:
    """A global the scan allowed, and what calling it builds."""

    __slots__ = ("builds", "name")

    def __init__(self, builds: Builds, name: str = ""):
        self.builds, self.name = builds, name


_NESTED = (_Box, _Frozen)
_SIZED = (_Box, _Frozen, _Blob)
# a number whose hash a file can choose (a big integer, a float) or the result of a call: as dict
# keys, values with one hash make each insertion scan all the others (quadratic time)
_COLLIDABLE = _GlobalRef(Builds.OBJECT)
_UNSET = object()  # a memo slot not written yet


def call_bytes(builds: Builds, n: int) -> int:
    """The bytes a call that ``builds`` allocates when its first argument has ``n`` items
    (characters, pairs)."""
    if builds is Builds.TUPLE:
        return _TUPLE + _TUPLE_ITEM * n
    if builds is Builds.SET or builds is Builds.FROZENSET:
        return _SET + _SET_ITEM * n
    if builds is Builds.DICT:
        return _DICT + _DICT_ITEM * n
    if builds is Builds.BYTES:
        return _BYTES + n
    return _CALL


def _extent(value: object) -> int:
    """How many items (or characters, or bytes) a call given ``value`` copies."""
    if value.__class__ is str:
        return len(value)
    return value.n if value.__class__ in _SIZED else 0


def scan(data: bytes, pos: int, where: str, complete: bool, allowed: Mapping[str, Builds],
         memory: int = 0) -> tuple[int, int]:
    """Check the pickle at ``data[pos:]`` without constructing it; returns where it ends, and
    ``memory`` (bytes counted for earlier pickles of the same file) plus the bytes of objects
    this one builds.

    A small symbolic run of the pickle machine: the stack holds what each opcode would push
    (strings as strings, so that STACK_GLOBAL names are known even when fetched from the memo;
    containers as their item count and nesting depth; long strings as their length; everything
    else as None). ``allowed`` maps each allowed global to what a call of it builds. Refuses
    (CheckpointError) a global outside the allow-list, an opcode in _REFUSED_OPCODES, a
    malformed pickle, and a pickle past a budget. Raises NeedMore when the bytes end before
    STOP and ``complete`` is false (more of the file may follow).
    """
    memory_budget = limit("pickle-memory")
    ops_budget = limit("pickle-opcodes")
    items_budget = limit("pickle-items")
    keys_budget = limit("pickle-hash-keys")
    odd_keys = 0
    depth_budget = limit("pickle-depth")
    digits_budget = limit("integer-digits")
    flat = [_Frozen(1, 1 + n, n) for n in range(4)]  # tuples of 0-3 items that hold nothing sized: never changed
    end = len(data)
    stack: list = []
    push = stack.append
    marks: list[int] = []
    memo: list = []  # index → value (_UNSET: not written); a list, so that the scan's own memo stays small
    fence = 0
    ops = 0
    start = pos

    def truncated():
        if not complete:
            raise NeedMore()
        raise CheckpointError(f"{where}: the pickle ends at byte {end - start} before its STOP opcode; "
                              "the file is truncated")

    def malformed(what: str):
        raise CheckpointError(f"{where}: corrupt pickle: {what} at byte {pos - start}; the file is corrupt")

    def line() -> bytes:
        nonlocal pos
        stop = data.find(b"\n", pos)
        if stop < 0:
            truncated()
        text = data[pos:stop]
        pos = stop + 1
        return text

    def pop_mark() -> list:
        nonlocal fence
        if not marks:
            malformed("an opcode that needs a MARK without one")
        mark = marks.pop()
        items = stack[mark:]
        del stack[mark:]
        fence = marks[-1] if marks else 0
        if len(items) > items_budget:
            check_limit("pickle-items", len(items), where)
        return items

    def over_memory(call: str = ""):
        if memory > memory_budget:
            check_limit("pickle-memory", memory, f"{where}, by byte {pos - start}{call}")

    def nesting(items) -> int:
        d = 0
        for x in items:
            if x.__class__ in _NESTED and x.d > d:
                d = x.d
        if d >= depth_budget:
            check_limit("pickle-depth", d + 1, where)
        return d + 1

    def frozen(items) -> _Frozen:
        w = 1
        for x in items:
            w += x.w if x.__class__ is _Frozen else 1
        return _Frozen(nesting(items), w, len(items), _extent(items[0]) if items else 0)

    def keyed(keys) -> None:
        # strings and bytes hash with a per-process secret, small integers to themselves: anything else may collide
        nonlocal odd_keys
        for k in keys:
            if k is not None and k.__class__ is not str and k.__class__ is not _Blob:
                odd_keys += k.w if k.__class__ is _Frozen else 1
        if odd_keys > keys_budget:
            check_limit("pickle-hash-keys", odd_keys, where)

    def grow(box, n: int, items) -> None:
        if box.__class__ is not _Box:
            return  # not a list, dict or set: the unpickler will refuse to add to it
        box.n += n
        if box.n > items_budget:
            check_limit("pickle-items", box.n, where)
        d = nesting(items)
        if d > box.d:
            box.d = d

    def memo_put(index: int) -> None:
        # the C unpickler sizes its memo by the largest index: a huge one would allocate gigabytes
        nonlocal memory
        if index > ops:
            malformed(f"memo index {index} (only {ops} opcodes so far)")
        if len(stack) <= fence:
            malformed("PUT with an empty stack")
        if index >= len(memo):
            memory += _MEMO_SLOT * (index + 1 - len(memo))
            over_memory()
            memo.extend([_UNSET] * (index + 1 - len(memo)))
        memo[index] = stack[-1]

    def memo_get(index: int) -> None:
        value = memo[index] if index < len(memo) else _UNSET
        if value is _UNSET:
            malformed(f"memo entry {index} read before it was written")
        push(value)

    def call(func: object, args: object) -> object:
        """What a REDUCE pushes; its size is counted first."""
        nonlocal memory
        builds = func.builds if func.__class__ is _GlobalRef else Builds.OBJECT
        if builds is Builds.OBJECT:
            memory += _CALL
            return args if args.__class__ is _Frozen else _COLLIDABLE  # nests no deeper than its arguments
        n = args.first if args.__class__ is _Frozen else 0
        memory += call_bytes(builds, n)
        over_memory(f" (a call of {quote(func.name[:200])})")
        # what a call returns nests no deeper than its arguments
        d, w = (args.d, args.w) if args.__class__ is _Frozen else (1, 1)
        if builds is Builds.SET or builds is Builds.DICT:
            return _Box(n, d)  # more items may be added
        return _Blob(n) if builds is Builds.BYTES else _Frozen(d, w, n)

    def allow(module: object, name: object) -> _GlobalRef:
        if type(module) is not str or type(name) is not str:
            malformed("STACK_GLOBAL without two strings")
        full = f"{module}.{name}"
        if full not in allowed:
            raise CheckpointError(
                f"{where}: the pickle calls {quote(full[:200])}, which fusectl refuses: a checkpoint may hold only "
                "tensors and plain containers, and no code from a checkpoint ever runs; if you trust the file, "
                "load it with torch and re-save its state dict (torch.save(model.state_dict(), ...))"
            )
        return _GlobalRef(allowed[full], full)

    while True:
        if pos >= end:
            truncated()
        op = data[pos]
        pos += 1
        ops += 1
        if not ops & 0xFFFF:  # the costs of single opcodes are small: added up, checked now and then
            if ops > ops_budget:
                check_limit("pickle-opcodes", ops, where)
            if len(stack) > items_budget:
                check_limit("pickle-items", len(stack), f"{where} (items waiting on the pickle stack)")
            over_memory()
        # the most frequent opcodes of a torch.save pickle first
        if op == 0x71:  # BINPUT
            if pos >= end:
                truncated()
            memo_put(data[pos])
            pos += 1
        elif op == 0x68:  # BINGET
            if pos >= end:
                truncated()
            memo_get(data[pos])
            pos += 1
        elif op in _SCALAR_FIXED:
            pos += _SCALAR_FIXED[op]
            if pos > end:
                truncated()
            if op > 0x4B:  # BININT2, BININT, BINFLOAT (N, K, NEWTRUE, NEWFALSE push shared objects)
                memory += _NUMBER
            push(_COLLIDABLE if op == 0x47 else None)  # BINFLOAT; the others are small integers
        elif op == 0x28:  # MARK
            marks.append(len(stack))
            fence = len(stack)
        elif 0x85 <= op <= 0x87:  # TUPLE1-3
            n = op - 0x84
            if len(stack) - fence < n:
                malformed("TUPLE with too few items")
            items = stack[-n:]
            del stack[-n:]
            memory += _TUPLE + _TUPLE_ITEM * n
            if items[0].__class__ is str or items[0].__class__ in _SIZED or any(x.__class__ in _NESTED for x in items):
                push(frozen(items))
            else:  # the common case (a shape, a stride): a flat tuple, shared
                push(flat[n])
        elif op in _COUNTED:
            n, fmt, text = _COUNTED[op]
            if pos + n > end:
                truncated()
            (length,) = struct.unpack_from(fmt, data, pos)
            pos += n
            if length < 0:
                malformed("a negative length")
            if pos + length > end:
                if complete:
                    malformed(f"a string of {length} bytes past the end of the pickle")
                truncated()
            value = None
            if text and length <= _LONG_TEXT:
                try:
                    value = data[pos:pos + length].decode("utf-8", "surrogatepass")
                except UnicodeDecodeError:
                    malformed("a string that is not UTF-8")
                memory += sys.getsizeof(value)
            else:
                memory += _STR + 4 * length if text else _BYTES + length
                value = _Blob(length)
                over_memory()
            pos += length
            push(value)
        elif op == 0x74:  # TUPLE
            items = pop_mark()
            memory += _TUPLE + _TUPLE_ITEM * len(items)
            push(frozen(items))
        elif op == 0x91:  # FROZENSET
            items = pop_mark()
            keyed(items)
            memory += _SET + _SET_ITEM * len(items)
            push(frozen(items))
        elif op == 0x52:  # REDUCE
            if len(stack) - fence < 2:
                malformed("REDUCE with too few items")
            args = stack.pop()
            stack[-1] = call(stack[-1], args)
        elif op == 0x51:  # BINPERSID
            if len(stack) <= fence:
                malformed("BINPERSID with an empty stack")
            memory += _CALL
            stack[-1] = None
        elif op == 0x29:  # EMPTY_TUPLE
            push(flat[0])
        elif op == 0x72:  # LONG_BINPUT
            if pos + 4 > end:
                truncated()
            index = int.from_bytes(data[pos:pos + 4], "little")
            pos += 4
            memo_put(index)
        elif op == 0x6A:  # LONG_BINGET
            if pos + 4 > end:
                truncated()
            memo_get(int.from_bytes(data[pos:pos + 4], "little"))
            pos += 4
        elif op == 0x94:  # MEMOIZE
            memo_put(len(memo))
        elif op == 0x70 or op == 0x67:  # PUT, GET (text)
            text = line()
            if not text.isdigit() or len(text) > digits_budget:
                malformed("a memo index that is not a small number")
            if op == 0x70:
                memo_put(int(text))
            else:
                memo_get(int(text))
        elif op == 0x7D or op == 0x5D or op == 0x8F:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
            memory += _DICT if op == 0x7D else _LIST if op == 0x5D else _SET
            push(_Box(0, 1))
        elif op == 0x6C:  # LIST
            items = pop_mark()
            memory += _LIST + _LIST_ITEM * len(items)
            push(_Box(len(items), nesting(items)))
        elif op == 0x64:  # DICT
            items = pop_mark()
            keyed(items[::2])
            memory += _DICT + _DICT_ITEM * (len(items) // 2)
            push(_Box(len(items) // 2, nesting(items)))
        elif op == 0x65 or op == 0x75 or op == 0x90:  # APPENDS, SETITEMS, ADDITEMS
            items = pop_mark()
            if len(stack) <= fence:
                malformed("items added to nothing")
            if op != 0x65:
                keyed(items[::2] if op == 0x75 else items)
            n = len(items) // 2 if op == 0x75 else len(items)
            memory += n * (_LIST_ITEM if op == 0x65 else _DICT_ITEM if op == 0x75 else _SET_ITEM)
            grow(stack[-1], n, items)
        elif op == 0x61:  # APPEND
            if len(stack) - fence < 2:
                malformed("APPEND with too few items")
            item = stack.pop()
            memory += _LIST_ITEM
            grow(stack[-1], 1, (item,))
        elif op == 0x73:  # SETITEM
            if len(stack) - fence < 3:
                malformed("SETITEM with too few items")
            items = stack[-2:]
            del stack[-2:]
            keyed(items[:1])
            memory += _DICT_ITEM
            grow(stack[-1], 1, items)
        elif op == 0x8A or op == 0x8B:  # LONG1, LONG4
            n = 1 if op == 0x8A else 4
            if pos + n > end:
                truncated()
            length = int.from_bytes(data[pos:pos + n], "little", signed=op == 0x8B)
            pos += n
            if length < 0:
                malformed("a negative length")
            if pos + length > end:
                truncated()
            if length * 2.408 > digits_budget:  # 256**length < 10**(2.409 * length)
                value = int.from_bytes(data[pos:pos + length], "little", signed=True) if length <= 64 else None
                if value is None or len(str(abs(value))) > digits_budget:
                    check_limit("integer-digits", math.ceil(length * 2.408), f"{where}: an integer of {length} bytes")
            pos += length
            memory += _NUMBER + length
            push(None if length < 8 else _COLLIDABLE)
        elif op in _LINE_SCALARS:
            text = line()
            digits = len(text.strip(b"-L"))
            if op in (0x49, 0x4C) and digits > digits_budget:  # INT, LONG
                check_limit("integer-digits", digits, f"{where}: an integer")
            if op in (0x53, 0x56):  # STRING, UNICODE: no longer than its line (quoted or escaped, never a name)
                memory += _STR + 4 * len(text)
                push(_Blob(len(text)))
                over_memory()
            else:
                memory += _NUMBER + digits
                push(None if op != 0x46 and digits < 18 else _COLLIDABLE)
        elif op == 0x63:  # GLOBAL
            module = line().decode("utf-8", "replace")
            memory += _GLOBAL
            push(allow(module, line().decode("utf-8", "replace")))
        elif op == 0x93:  # STACK_GLOBAL
            if len(stack) - fence < 2:
                malformed("STACK_GLOBAL with too few items")
            name = stack.pop()
            memory += _GLOBAL
            push(allow(stack.pop(), name))
        elif op == 0x62:  # BUILD
            if len(stack) - fence < 2:
                malformed("BUILD with too few items")
            stack.pop()
        elif op == 0x50:  # PERSID
            line()
            push(None)
        elif op == 0x30:  # POP
            if len(stack) > fence:
                stack.pop()
            elif marks:
                marks.pop()
                fence = marks[-1] if marks else 0
            else:
                malformed("POP with an empty stack")
        elif op == 0x31:  # POP_MARK
            pop_mark()
        elif op == 0x32:  # DUP
            if len(stack) <= fence:
                malformed("DUP with an empty stack")
            push(stack[-1])
        elif op == 0x80:  # PROTO
            if pos >= end:
                truncated()
            if data[pos] > pickle.HIGHEST_PROTOCOL:
                malformed(f"pickle protocol {data[pos]}")
            pos += 1
        elif op == 0x95:  # FRAME (a hint; the opcodes inside are scanned as any others)
            if pos + 8 > end:
                truncated()
            (length,) = struct.unpack_from("<Q", data, pos)
            pos += 8
            if pos + length > end and complete:
                malformed(f"a frame of {length} bytes past the end of the pickle")
            memory += _BYTES + min(length, end - pos)  # the unpickler reads a frame into a buffer of its own
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks:
                malformed("STOP with a stack that does not hold exactly one object")
            if ops > ops_budget:
                check_limit("pickle-opcodes", ops, where)
            over_memory()
            return pos, memory
        elif op in _REFUSED_OPCODES:
            raise CheckpointError(
                f"{where}: the pickle uses opcode {_REFUSED_OPCODES[op]} (at byte {pos - 1 - start}), which builds "
                "arbitrary objects; a state dict never needs it, and fusectl runs no code from a checkpoint"
            )
        else:
            malformed(f"unknown opcode 0x{op:02x}")
