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

The machine (:class:`_Machine`: its state and the checks all opcodes share) runs a table indexed
by opcode byte. Each family of opcodes is one class whose methods say, by ``@_handles``, which
opcodes they run: :class:`_Numbers`, :class:`_Strings`, :class:`_Containers`, :class:`_Memo`,
:class:`_Stack` (MARK, POP, DUP), :class:`_Calls` (globals, REDUCE, BUILD, persistent ids),
:class:`_Framing` (PROTO, FRAME, STOP) and :class:`_Refused`; a byte no family claims is an
unknown opcode.
"""

from __future__ import annotations

import enum
import math
import pickle
import pickletools
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
    # an object of a class a format allows (DCP's metadata classes), made by NEWOBJ of no
    # arguments and given its state by BUILD, or called with arguments (an enum's value)
    RECORD = "a record of its class, its arguments and its state"


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

    A small symbolic run of the pickle machine (:class:`_Scanner`): the stack holds what each
    opcode would push (strings as strings, so that STACK_GLOBAL names are known even when
    fetched from the memo; containers as their item count and nesting depth; long strings as
    their length; everything else as None). ``allowed`` maps each allowed global to what a call
    of it builds. Refuses (CheckpointError) a global outside the allow-list, an opcode that
    builds arbitrary objects (:class:`_Refused`), a malformed pickle, and a pickle past a
    budget. Raises NeedMore when the bytes end before STOP and ``complete`` is false (more of
    the file may follow).

    >>> data = pickle.dumps({"w": (1, 2)}, protocol=2)
    >>> scan(data, 0, "m.pt", True, {})[0] == len(data)
    True
    >>> scan(pickle.dumps(print), 0, "m.pt", True, {})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    fusectl.errors.CheckpointError: m.pt: the pickle calls 'builtins.print', which fusectl refuses: ...
    """
    return _Scanner(data, pos, where, complete, allowed, memory).run()


# ------------------------------------------------------------------------------ the machine's state
_CODES = {op.name: ord(op.code) for op in pickletools.opcodes}  # opcode name → byte
_NAMES = {code: name for name, code in _CODES.items()}
_FLAT = tuple(_Frozen(1, 1 + n, n) for n in range(4))  # tuples of 0-3 items that hold nothing sized: shared


def _handles(*names: str):
    """Marks a method of a family as the handler of the opcodes ``names`` (pickletools' names)."""
    def mark(method):
        method.opcodes = names
        return method
    return mark


class _Machine:
    """What a scan knows as it goes, and the checks every opcode family shares.

    ``pos`` is the next byte to read (``start`` where the pickle began, ``end`` where the bytes
    read so far end), ``stack`` and ``marks`` the pickle machine's stack and the stack heights
    of its open MARKs (``fence``: the innermost, below which no opcode may reach), ``memo`` its
    memo (index → value, :data:`_UNSET` where not written), ``ops`` the opcodes run so far,
    ``memory`` the bytes counted, ``odd_keys`` the dict and set keys whose hash a file chooses.

    A handler of an opcode is called as ``handler(machine, op)`` after ``pos`` has moved past
    the opcode's byte; it reads its argument, moves ``pos`` past it, and returns True only when
    the pickle is complete (STOP).
    """

    __slots__ = ("data", "pos", "start", "end", "where", "complete", "allowed", "memory", "stack", "marks",
                 "memo", "fence", "ops", "odd_keys", "memory_budget", "ops_budget", "items_budget",
                 "keys_budget", "depth_budget", "digits_budget")

    def __init__(self, data: bytes, pos: int, where: str, complete: bool, allowed: Mapping[str, Builds],
                 memory: int = 0):
        self.data, self.pos, self.start, self.end = data, pos, pos, len(data)
        self.where, self.complete, self.allowed, self.memory = where, complete, allowed, memory
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: list = []  # a list, so that the scan's own memo stays small
        self.fence = self.ops = self.odd_keys = 0
        self.memory_budget = limit("pickle-memory")
        self.ops_budget = limit("pickle-opcodes")
        self.items_budget = limit("pickle-items")
        self.keys_budget = limit("pickle-hash-keys")
        self.depth_budget = limit("pickle-depth")
        self.digits_budget = limit("integer-digits")

    # -------------------------------------------------------------------------- refusals
    def truncated(self):
        if not self.complete:
            raise NeedMore()
        raise CheckpointError(f"{self.where}: the pickle ends at byte {self.end - self.start} before its STOP "
                              "opcode; the file is truncated")

    def malformed(self, what: str):
        raise CheckpointError(f"{self.where}: corrupt pickle: {what} at byte {self.pos - self.start}; "
                              "the file is corrupt")

    def unknown(self, op: int):
        """The handler of every byte that is no opcode."""
        self.malformed(f"unknown opcode 0x{op:02x}")

    # -------------------------------------------------------------------------- budgets
    def over_memory(self, call: str = "") -> None:
        if self.memory > self.memory_budget:
            check_limit("pickle-memory", self.memory, f"{self.where}, by byte {self.pos - self.start}{call}")

    def now_and_then(self) -> None:
        """The budgets that single opcodes add to in small steps, checked every 65536 opcodes."""
        if self.ops > self.ops_budget:
            check_limit("pickle-opcodes", self.ops, self.where)
        if len(self.stack) > self.items_budget:
            check_limit("pickle-items", len(self.stack), f"{self.where} (items waiting on the pickle stack)")
        self.over_memory()

    # -------------------------------------------------------------------------- reading arguments
    def take(self, n: int) -> int:
        """Moves past an argument of ``n`` bytes; returns where it starts."""
        pos = self.pos
        if pos + n > self.end:
            self.truncated()
        self.pos = pos + n
        return pos

    def line(self) -> bytes:
        """The argument of a text opcode: the bytes up to the next newline."""
        stop = self.data.find(b"\n", self.pos)
        if stop < 0:
            self.truncated()
        text = self.data[self.pos:stop]
        self.pos = stop + 1
        return text

    def need(self, n: int, what: str) -> None:
        """The stack holds at least ``n`` items above the innermost MARK."""
        if len(self.stack) - self.fence < n:
            self.malformed(what)

    # -------------------------------------------------------------------------- the values on the stack
    def pop_mark(self) -> list:
        """The items above the innermost MARK, taken off the stack with it."""
        marks = self.marks
        if not marks:
            self.malformed("an opcode that needs a MARK without one")
        mark = marks.pop()
        stack = self.stack
        items = stack[mark:]
        del stack[mark:]
        self.fence = marks[-1] if marks else 0
        if len(items) > self.items_budget:
            check_limit("pickle-items", len(items), self.where)
        return items

    def nesting(self, items) -> int:
        """The nesting depth of a container of ``items``."""
        d = 0
        for x in items:
            if x.__class__ in _NESTED and x.d > d:
                d = x.d
        if d >= self.depth_budget:
            check_limit("pickle-depth", d + 1, self.where)
        return d + 1

    def frozen(self, items) -> _Frozen:
        """A tuple or frozenset of ``items``."""
        w = 1
        for x in items:
            w += x.w if x.__class__ is _Frozen else 1
        return _Frozen(self.nesting(items), w, len(items), _extent(items[0]) if items else 0)

    def keyed(self, keys) -> None:
        """Counts the dict or set keys whose hash the file chooses."""
        # strings and bytes hash with a per-process secret, small integers to themselves: anything else may collide
        for k in keys:
            if k is not None and k.__class__ is not str and k.__class__ is not _Blob:
                self.odd_keys += k.w if k.__class__ is _Frozen else 1
        if self.odd_keys > self.keys_budget:
            check_limit("pickle-hash-keys", self.odd_keys, self.where)

    def grow(self, box, n: int, items) -> None:
        """``n`` more items (``items``) in the list, dict or set ``box``."""
        if box.__class__ is not _Box:
            return  # not a list, dict or set: the unpickler will refuse to add to it
        box.n += n
        if box.n > self.items_budget:
            check_limit("pickle-items", box.n, self.where)
        d = self.nesting(items)
        if d > box.d:
            box.d = d


# ------------------------------------------------------------------------------ the opcode families
class _Numbers(_Machine):
    """Opcodes that push a constant or a number."""

    __slots__ = ()
    # (argument bytes, memory charged): None, True, False and BININT1's 0..255 are shared objects
    # in CPython; BININT2, BININT and BINFLOAT make a new int or float each
    _FIXED = {0x4E: (0, 0), 0x88: (0, 0), 0x89: (0, 0), 0x4B: (1, 0), 0x4A: (4, _NUMBER),
              0x47: (8, _NUMBER), 0x4D: (2, _NUMBER)}

    @_handles("NONE", "NEWTRUE", "NEWFALSE", "BININT1", "BININT2", "BININT", "BINFLOAT")
    def fixed(self, op: int) -> None:
        n, charge = self._FIXED[op]
        self.pos += n
        if self.pos > self.end:
            self.truncated()
        self.memory += charge
        self.stack.append(_COLLIDABLE if op == 0x47 else None)  # BINFLOAT; the others are small integers

    @_handles("LONG1", "LONG4")
    def binary_long(self, op: int) -> None:
        n = 1 if op == 0x8A else 4
        at = self.take(n)
        length = int.from_bytes(self.data[at:at + n], "little", signed=op == 0x8B)
        if length < 0:
            self.malformed("a negative length")
        at = self.take(length)
        digits_budget = self.digits_budget
        if length * 2.408 > digits_budget:  # 256**length < 10**(2.409 * length)
            value = int.from_bytes(self.data[at:at + length], "little", signed=True) if length <= 64 else None
            if value is None or len(str(abs(value))) > digits_budget:
                check_limit("integer-digits", math.ceil(length * 2.408), f"{self.where}: an integer of {length} bytes")
        self.memory += _NUMBER + length
        self.stack.append(None if length < 8 else _COLLIDABLE)

    @_handles("INT", "LONG", "FLOAT")
    def text_number(self, op: int) -> None:
        digits = len(self.line().strip(b"-L"))
        if op != 0x46 and digits > self.digits_budget:
            check_limit("integer-digits", digits, f"{self.where}: an integer")
        self.memory += _NUMBER + digits
        self.stack.append(None if op != 0x46 and digits < 18 else _COLLIDABLE)


class _Strings(_Machine):
    """Opcodes that push a string or bytes. A short string is pushed as itself (it may name a
    global), a long one, and bytes, as its length."""

    __slots__ = ()
    # opcode → (length bytes, struct format, is text)
    _COUNTED = {
        0x58: (4, "<I", True), 0x8C: (1, "<B", True), 0x8D: (8, "<Q", True),  # BINUNICODE, SHORT_, 8
        0x42: (4, "<I", False), 0x43: (1, "<B", False), 0x8E: (8, "<Q", False),  # BINBYTES, SHORT_, 8
        0x54: (4, "<i", False), 0x55: (1, "<B", False), 0x96: (8, "<Q", False),  # BINSTRING, SHORT_, BYTEARRAY8
    }
    _LONG_TEXT = 1 << 10  # strings longer than this never name a global

    @_handles("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
              "BINSTRING", "SHORT_BINSTRING", "BYTEARRAY8")
    def counted(self, op: int) -> None:
        n, fmt, text = self._COUNTED[op]
        pos = self.take(n)
        (length,) = struct.unpack_from(fmt, self.data, pos)
        pos += n
        if length < 0:
            self.malformed("a negative length")
        if pos + length > self.end:
            if self.complete:
                self.malformed(f"a string of {length} bytes past the end of the pickle")
            self.truncated()
        if text and length <= self._LONG_TEXT:
            try:
                value = self.data[pos:pos + length].decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                self.malformed("a string that is not UTF-8")
            self.memory += sys.getsizeof(value)
        else:
            self.memory += _STR + 4 * length if text else _BYTES + length
            value = _Blob(length)
            self.over_memory()
        self.pos = pos + length
        self.stack.append(value)

    @_handles("STRING", "UNICODE")
    def text_string(self, op: int) -> None:
        """No longer than its line (quoted or escaped, so never a name)."""
        n = len(self.line())
        self.memory += _STR + 4 * n
        self.stack.append(_Blob(n))
        self.over_memory()


class _Containers(_Machine):
    """Opcodes that build a tuple, list, dict, set or frozenset, or add items to one."""

    __slots__ = ()

    @_handles("EMPTY_TUPLE")
    def empty_tuple(self, op: int) -> None:
        self.stack.append(_FLAT[0])

    @_handles("TUPLE1", "TUPLE2", "TUPLE3")
    def small_tuple(self, op: int) -> None:
        n = op - 0x84
        self.need(n, "TUPLE with too few items")
        stack = self.stack
        items = stack[-n:]
        del stack[-n:]
        self.memory += _TUPLE + _TUPLE_ITEM * n
        if items[0].__class__ is str or items[0].__class__ in _SIZED or any(x.__class__ in _NESTED for x in items):
            stack.append(self.frozen(items))
        else:  # the common case (a shape, a stride): a flat tuple, shared
            stack.append(_FLAT[n])

    @_handles("TUPLE")
    def tuple(self, op: int) -> None:
        items = self.pop_mark()
        self.memory += _TUPLE + _TUPLE_ITEM * len(items)
        self.stack.append(self.frozen(items))

    @_handles("FROZENSET")
    def frozenset(self, op: int) -> None:
        items = self.pop_mark()
        self.keyed(items)
        self.memory += _SET + _SET_ITEM * len(items)
        self.stack.append(self.frozen(items))

    _EMPTY = {0x7D: _DICT, 0x5D: _LIST, 0x8F: _SET}

    @_handles("EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET")
    def empty(self, op: int) -> None:
        self.memory += self._EMPTY[op]
        self.stack.append(_Box(0, 1))

    @_handles("LIST")
    def list(self, op: int) -> None:
        items = self.pop_mark()
        self.memory += _LIST + _LIST_ITEM * len(items)
        self.stack.append(_Box(len(items), self.nesting(items)))

    @_handles("DICT")
    def dict(self, op: int) -> None:
        items = self.pop_mark()
        self.keyed(items[::2])
        self.memory += _DICT + _DICT_ITEM * (len(items) // 2)
        self.stack.append(_Box(len(items) // 2, self.nesting(items)))

    @_handles("APPENDS", "SETITEMS", "ADDITEMS")
    def add_marked(self, op: int) -> None:
        items = self.pop_mark()
        if len(self.stack) <= self.fence:
            self.malformed("items added to nothing")
        if op == 0x65:  # APPENDS
            n, charge = len(items), _LIST_ITEM
        elif op == 0x75:  # SETITEMS
            self.keyed(items[::2])
            n, charge = len(items) // 2, _DICT_ITEM
        else:  # ADDITEMS
            self.keyed(items)
            n, charge = len(items), _SET_ITEM
        self.memory += n * charge
        self.grow(self.stack[-1], n, items)

    @_handles("APPEND")
    def append(self, op: int) -> None:
        self.need(2, "APPEND with too few items")
        item = self.stack.pop()
        self.memory += _LIST_ITEM
        self.grow(self.stack[-1], 1, (item,))

    @_handles("SETITEM")
    def setitem(self, op: int) -> None:
        self.need(3, "SETITEM with too few items")
        stack = self.stack
        items = stack[-2:]
        del stack[-2:]
        self.keyed(items[:1])
        self.memory += _DICT_ITEM
        self.grow(stack[-1], 1, items)


class _Memo(_Machine):
    """Opcodes that write the top of the stack to the memo, or push a value from it."""

    __slots__ = ()

    def put(self, index: int) -> None:
        # the C unpickler sizes its memo by the largest index: a huge one would allocate gigabytes
        if index > self.ops:
            self.malformed(f"memo index {index} (only {self.ops} opcodes so far)")
        if len(self.stack) <= self.fence:
            self.malformed("PUT with an empty stack")
        memo = self.memo
        if index >= len(memo):
            self.memory += _MEMO_SLOT * (index + 1 - len(memo))
            self.over_memory()
            memo.extend([_UNSET] * (index + 1 - len(memo)))
        memo[index] = self.stack[-1]

    def get(self, index: int) -> None:
        memo = self.memo
        value = memo[index] if index < len(memo) else _UNSET
        if value is _UNSET:
            self.malformed(f"memo entry {index} read before it was written")
        self.stack.append(value)

    @_handles("BINPUT")
    def binput(self, op: int) -> None:
        pos = self.pos
        if pos >= self.end:
            self.truncated()
        self.put(self.data[pos])  # a refusal names the index's byte
        self.pos = pos + 1

    @_handles("LONG_BINPUT")
    def long_binput(self, op: int) -> None:
        at = self.take(4)
        self.put(int.from_bytes(self.data[at:at + 4], "little"))

    @_handles("MEMOIZE")
    def memoize(self, op: int) -> None:
        self.put(len(self.memo))

    @_handles("BINGET")
    def binget(self, op: int) -> None:
        pos = self.pos
        if pos >= self.end:
            self.truncated()
        self.get(self.data[pos])
        self.pos = pos + 1

    @_handles("LONG_BINGET")
    def long_binget(self, op: int) -> None:
        pos = self.pos
        if pos + 4 > self.end:
            self.truncated()
        self.get(int.from_bytes(self.data[pos:pos + 4], "little"))
        self.pos = pos + 4

    @_handles("PUT", "GET")
    def text_memo(self, op: int) -> None:
        text = self.line()
        if not text.isdigit() or len(text) > self.digits_budget:
            self.malformed("a memo index that is not a small number")
        if op == 0x70:
            self.put(int(text))
        else:
            self.get(int(text))


class _Stack(_Machine):
    """Opcodes that open a MARK or take items off the stack."""

    __slots__ = ()

    @_handles("MARK")
    def mark(self, op: int) -> None:
        self.marks.append(len(self.stack))
        self.fence = len(self.stack)

    @_handles("POP")
    def pop(self, op: int) -> None:
        if len(self.stack) > self.fence:
            self.stack.pop()
        elif self.marks:
            self.marks.pop()
            self.fence = self.marks[-1] if self.marks else 0
        else:
            self.malformed("POP with an empty stack")

    @_handles("POP_MARK")
    def pop_to_mark(self, op: int) -> None:
        self.pop_mark()

    @_handles("DUP")
    def dup(self, op: int) -> None:
        if len(self.stack) <= self.fence:
            self.malformed("DUP with an empty stack")
        self.stack.append(self.stack[-1])


class _Calls(_Machine):
    """Opcodes that name a global, call one, set an object's state, or load a persistent id
    (torch.save's storages): the allow-list is checked here, and what a call builds counted."""

    __slots__ = ()

    def allow(self, module: object, name: object) -> _GlobalRef:
        if type(module) is not str or type(name) is not str:
            self.malformed("STACK_GLOBAL without two strings")
        full = f"{module}.{name}"
        if full not in self.allowed:
            raise CheckpointError(
                f"{self.where}: the pickle calls {quote(full[:200])}, which fusectl refuses: a checkpoint may hold "
                "only tensors and plain containers, and no code from a checkpoint ever runs; if you trust the file, "
                "load it with torch and re-save its state dict (torch.save(model.state_dict(), ...))"
            )
        return _GlobalRef(self.allowed[full], full)

    def call(self, func: object, args: object) -> object:
        """What a REDUCE of ``func`` on ``args`` pushes; its size is counted first."""
        builds = func.builds if func.__class__ is _GlobalRef else Builds.OBJECT
        if builds is Builds.OBJECT or builds is Builds.RECORD:
            self.memory += _CALL
            return args if args.__class__ is _Frozen else _COLLIDABLE  # nests no deeper than its arguments
        n = args.first if args.__class__ is _Frozen else 0
        self.memory += call_bytes(builds, n)
        self.over_memory(f" (a call of {quote(func.name[:200])})")
        # what a call returns nests no deeper than its arguments
        d, w = (args.d, args.w) if args.__class__ is _Frozen else (1, 1)
        if builds is Builds.SET or builds is Builds.DICT:
            return _Box(n, d)  # more items may be added
        return _Blob(n) if builds is Builds.BYTES else _Frozen(d, w, n)

    @_handles("GLOBAL")
    def text_global(self, op: int) -> None:
        module = self.line().decode("utf-8", "replace")
        self.memory += _GLOBAL
        self.stack.append(self.allow(module, self.line().decode("utf-8", "replace")))

    @_handles("STACK_GLOBAL")
    def stack_global(self, op: int) -> None:
        self.need(2, "STACK_GLOBAL with too few items")
        stack = self.stack
        name = stack.pop()
        self.memory += _GLOBAL
        stack.append(self.allow(stack.pop(), name))

    @_handles("REDUCE")
    def reduce(self, op: int) -> None:
        self.need(2, "REDUCE with too few items")
        stack = self.stack
        args = stack.pop()
        stack[-1] = self.call(stack[-1], args)

    @_handles("NEWOBJ")
    def newobj(self, op: int) -> None:
        """``cls.__new__(cls)``: only for a class the caller allows as a record, with no arguments
        (a dataclass's instance, whose state BUILD then sets); refused for any other class."""
        stack = self.stack
        cls, args = stack[-2:] if len(stack) - self.fence >= 2 else (None, None)
        if cls.__class__ is not _GlobalRef or cls.builds is not Builds.RECORD or \
                args.__class__ is not _Frozen or args.n:
            _Refused.refuse(self, op)
        stack.pop()
        self.memory += _CALL
        stack[-1] = _COLLIDABLE

    @_handles("BUILD")
    def build(self, op: int) -> None:
        self.need(2, "BUILD with too few items")
        self.stack.pop()

    @_handles("BINPERSID")
    def binpersid(self, op: int) -> None:
        if len(self.stack) <= self.fence:
            self.malformed("BINPERSID with an empty stack")
        self.memory += _CALL
        self.stack[-1] = None

    @_handles("PERSID")
    def persid(self, op: int) -> None:
        self.line()
        self.stack.append(None)


class _Framing(_Machine):
    """Opcodes that say the protocol, frame the opcodes that follow, or end the pickle."""

    __slots__ = ()

    @_handles("PROTO")
    def proto(self, op: int) -> None:
        pos = self.pos
        if pos >= self.end:
            self.truncated()
        if self.data[pos] > pickle.HIGHEST_PROTOCOL:
            self.malformed(f"pickle protocol {self.data[pos]}")
        self.pos = pos + 1

    @_handles("FRAME")
    def frame(self, op: int) -> None:
        """A hint: the opcodes inside are scanned as any others."""
        (length,) = struct.unpack_from("<Q", self.data, self.take(8))
        if self.pos + length > self.end and self.complete:
            self.malformed(f"a frame of {length} bytes past the end of the pickle")
        self.memory += _BYTES + min(length, self.end - self.pos)  # the unpickler reads a frame into a buffer of its own

    @_handles("STOP")
    def stop(self, op: int) -> bool:
        if len(self.stack) != 1 or self.marks:
            self.malformed("STOP with a stack that does not hold exactly one object")
        if self.ops > self.ops_budget:
            check_limit("pickle-opcodes", self.ops, self.where)
        self.over_memory()
        return True


class _Refused(_Machine):
    """Opcodes a state dict never needs that would build arbitrary objects, or read outside the pickle."""

    __slots__ = ()

    @_handles("INST", "OBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER")
    def refuse(self, op: int) -> None:
        raise CheckpointError(
            f"{self.where}: the pickle uses opcode {_NAMES[op]} (at byte {self.pos - 1 - self.start}), which "
            "builds arbitrary objects; a state dict never needs it, and fusectl runs no code from a checkpoint"
        )


_FAMILIES = (_Numbers, _Strings, _Containers, _Memo, _Stack, _Calls, _Framing, _Refused)


class _Scanner(*_FAMILIES):
    """The scan: every family's handlers in one table, indexed by opcode byte."""

    __slots__ = ()

    def run(self) -> tuple[int, int]:
        """Runs opcodes to STOP; returns where the pickle ends and the memory counted."""
        table, data, end = _TABLE, self.data, self.end
        while True:
            pos = self.pos
            if pos >= end:
                self.truncated()
            op = data[pos]
            self.pos = pos + 1
            ops = self.ops = self.ops + 1
            if not ops & 0xFFFF:  # the costs of single opcodes are small: added up, checked now and then
                self.now_and_then()
            if table[op](self, op):
                return self.pos, self.memory


def _table() -> list:
    """Handler of each opcode byte: the families' marked methods; :meth:`_Machine.unknown` elsewhere."""
    table = [_Machine.unknown] * 256
    for family in _FAMILIES:
        for method in vars(family).values():
            for name in getattr(method, "opcodes", ()):
                table[_CODES[name]] = method
    return table


_TABLE = _table()
