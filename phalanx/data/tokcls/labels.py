"""Tag names: their stable order, the tagging scheme they follow, and the names seqeval reads.

A tag is 'O', a prefixed entity tag ('B-PER', 'I-PER', 'E-PER', 'S-PER') or a plain tag ('PER', 'NOUN').
"""
from __future__ import annotations

PREFIX_ORDER = {"B": 0, "I": 1, "E": 2, "S": 3, "L": 4, "U": 5}


def split_tag(tag: str) -> tuple[str, str]:
    """(prefix, type): 'B-PER' -> ('B', 'PER'); 'O' -> ('O', ''); 'NOUN' (plain) -> ('', 'NOUN')."""
    if tag == "O":
        return "O", ""
    if len(tag) > 2 and tag[1] == "-" and tag[0] in PREFIX_ORDER:
        return tag[0], tag[2:]
    return "", tag


def ordered(tags) -> list[str]:
    """The stable order of a label set: O first, then by entity type, then B, I, E, S within a type."""
    def key(tag: str):
        prefix, kind = split_tag(tag)
        return (prefix != "O", kind, PREFIX_ORDER.get(prefix, -1), tag)
    return sorted(set(tags), key=key)


def scheme(names: list[str], inside_starts: int) -> str:
    """The tagging scheme of a label set: BIOES (E- or S- tags), IOB1 (I- starts an entity somewhere in the
    training data: `inside_starts` counts an I-X after O or after another type), IOB2 (B- starts every entity),
    or plain (no prefixes)."""
    prefixes = {split_tag(n)[0] for n in names} - {"O"}
    if not prefixes or prefixes == {""}:
        return "plain"
    if prefixes & {"E", "S", "L", "U"}:
        return "BIOES"
    return "IOB1" if inside_starts else "IOB2"


def inside_starts(tags: list[str]) -> int:
    """How many I-X tags of a sentence start an entity (after O, a sentence start or another type): IOB1's mark."""
    count, before = 0, ("O", "")
    for tag in tags:
        prefix, kind = split_tag(tag)
        if prefix == "I" and (before[0] not in ("B", "I") or before[1] != kind):
            count += 1
        before = (prefix, kind)
    return count


def continuation(names: list[str]) -> list[int]:
    """Per label id, the id a word's later subwords get when every subword is labelled: B-X -> I-X (where I-X
    is a label), else the same label (as transformers' run_ner.py does)."""
    index = {n: i for i, n in enumerate(names)}
    return [index.get("I-" + n[2:], i) if n.startswith("B-") else i for i, n in enumerate(names)]


def for_seqeval(names: list[str], plain: bool) -> list[str]:
    """Names as seqeval reads them: plain tags become I-X (each run of one tag is an entity), O stays."""
    return [n if not plain or n == "O" else f"I-{n}" for n in names]
