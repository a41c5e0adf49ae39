"""Sets of record ids in little memory: the duplicate check of an input, and the ids an output already
holds."""
from __future__ import annotations

MAX_NUMBER_DIGITS = 18  # a longer digit tail is not read as a number (and int() refuses past 4300 digits)
MAX_FAMILIES = 16  # id families given a bitmap; the ids of further families go to the set
SLACK_BITS = 1 << 16  # what a bitmap may span beyond 8 bits per record


class _Family:
    """The values met in one (prefix, width) family of ids: value v is bit v - base of `bits`."""

    __slots__ = ("base", "bits")

    def __init__(self, base: int):
        self.base = base
        self.bits = bytearray()


class SeenIds:
    """An exact set of record ids in little memory: the duplicate check (fit for a resumed run's done ids).

    An id splits one-to-one into a prefix and the value and width of its trailing ASCII digits: "17" is
    ("", 17, width 0), "req-17" ("req-", 17, width 0), "req-0017" ("req-", 17, width 4); width 0 means digits
    without a leading zero. The values of one (prefix, width) family are bits of a bitmap that starts at the
    first value met (rounded down to a byte): where ids count records (line numbers, the default; "req-N";
    "doc-000N") that is an eighth of a byte per id. A bitmap spans at most 8 bits per record (the line/row
    number, or the ids held, whichever is larger) plus SLACK_BITS, and only the first MAX_FAMILIES families
    get one; any other id (sparse or random numbers, a value below its family's start, no digits) is kept in
    a set, about 100 bytes each for short ids.
    """

    def __init__(self) -> None:
        self._families: dict[tuple[str, int], _Family] = {}
        self._others: set[str] = set()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @staticmethod
    def _split(record_id: str) -> tuple[tuple[str, int], int] | None:
        """((prefix, width), value), or None for an id without a digit tail of at most MAX_NUMBER_DIGITS."""
        prefix = record_id.rstrip("0123456789")
        digits = record_id[len(prefix):]
        if not digits or len(digits) > MAX_NUMBER_DIGITS:
            return None
        width = len(digits) if len(digits) > 1 and digits[0] == "0" else 0
        return (prefix, width), int(digits)

    def __contains__(self, record_id: str) -> bool:
        split = self._split(record_id)
        if split is not None:
            family = self._families.get(split[0])
            if family is not None:
                i = split[1] - family.base
                if 0 <= i < 8 * len(family.bits) and family.bits[i >> 3] & (1 << (i & 7)):
                    return True
        return record_id in self._others  # a bitmap may have grown over values that went to the set

    def add(self, record_id: str, number: int = 0) -> None:
        """Hold `record_id`, met at line/row `number` (0: not from an input, e.g. read from an output)."""
        if record_id in self:
            return
        self._len += 1
        split = self._split(record_id)
        if split is None or not self._set_bit(*split, max_bits=8 * max(number, self._len) + SLACK_BITS):
            self._others.add(record_id)

    def _set_bit(self, key: tuple[str, int], value: int, max_bits: int) -> bool:
        """Set `value`'s bit in its family's bitmap; False if it has none or the bit lies past `max_bits`."""
        family = self._families.get(key)
        if family is None:
            if len(self._families) >= MAX_FAMILIES:
                return False
            family = self._families[key] = _Family(value & ~7)
        i = value - family.base
        if i < 0 or i >= max_bits:
            return False
        if i >= 8 * len(family.bits):  # grow by doubling (amortized O(1) per id), within max_bits
            size = min(max(2 * len(family.bits), (i >> 3) + 1), (max_bits + 7) >> 3)
            family.bits.extend(bytes(size - len(family.bits)))
        family.bits[i >> 3] |= 1 << (i & 7)
        return True
