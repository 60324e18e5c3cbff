"""A multi-tenant radix tree of what a router has sent where: the "approximate tree" of the peer
routers (Ray Serve LLM's PrefixCacheAffinityRouter, sgl-router's cache_aware policy).

Each tenant (replica) owns the path of every string routed to it; a node records which tenants
own it and how many characters each tenant owns in all. Strings are prompt text (Ray: one
character per character) or token ids written one character per token (`token_key`; sgl's
token tree on its gRPC path), so the same tree serves both.

    insert "hello world" -> a, "help me" -> b:

    root {a, b}
     └─ "hel" {a, b}
         ├─ "lo world" {a}
         └─ "p me" {b}              size: a = 11 chars, b = 7 chars

`match(text)` walks down while the next node shares characters with `text` (and, when
`tenants` is given, is owned by one of them, as Ray's `prefix_match(text, available_tenants)`
does), stopping inside a node on a partial match; it returns how many characters matched and
the tenants owning the last node reached. Neither peer evicts by default at the sizes we run
(Ray: do_eviction=False; sgl: 2^26 characters per tenant), so there is no eviction here: the
tree remembers what was sent, not what the engines still cache, exactly as theirs do.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence


def token_key(token_ids: Sequence[int]) -> str:
    """Token ids as a string of one character per token, so that a character-level tree is a
    token-level tree (Python strings hold any code point below 0x110000, surrogates included)."""
    return "".join(map(chr, token_ids))


def _shared(edge: str, text: str, start: int) -> int:
    """Characters of `edge` equal to text[start:...] from its beginning (C-speed comparisons)."""
    if text.startswith(edge, start):
        return len(edge)
    lo, hi = 0, min(len(edge), len(text) - start)  # edge[:lo] matches, edge[:hi + 1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("text", "children", "owners")

    def __init__(self, text: str) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}  # first character -> child
        self.owners: dict[str, float] = {}  # tenant -> last time it was routed through here


class PrefixTree:
    def __init__(self) -> None:
        self.root = _Node("")
        self.size: dict[str, int] = {}  # tenant -> characters it owns (insertion order kept)

    def add_tenant(self, tenant: str, now: float = 0.0) -> None:
        if tenant not in self.size:
            self.size[tenant] = 0
            self.root.owners[tenant] = now

    def remove_tenant(self, tenant: str) -> None:
        if self.size.pop(tenant, None) is None:
            return
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.owners.pop(tenant, None)
            for first, child in list(node.children.items()):
                if tenant not in child.owners:
                    continue
                if len(child.owners) == 1:  # ownership is prefix-closed: the whole subtree was its alone
                    del node.children[first]
                else:
                    stack.append(child)

    def insert(self, text: str, tenant: str, now: float) -> None:
        self.add_tenant(tenant, now)
        node, i = self.root, 0
        node.owners[tenant] = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = node.children[text[i]] = _Node(text[i:])
            n = _shared(child.text, text, i)
            if n < len(child.text):  # split: child keeps the tail under a new node for the head
                head = _Node(child.text[:n])
                head.owners = dict(child.owners)
                child.text = child.text[n:]
                head.children[child.text[0]] = child
                node.children[text[i]] = child = head
            if tenant not in child.owners:
                self.size[tenant] += len(child.text)
            child.owners[tenant] = now
            node, i = child, i + n

    def match(self, text: str, tenants: Collection[str] | None = None) -> tuple[int, list[str]]:
        """(characters of `text` matched, tenants owning the node where the match ended)."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None or (tenants is not None and not any(t in child.owners for t in tenants)):
                break
            n = _shared(child.text, text, i)
            node, i = child, i + n
            if n < len(child.text):
                break
        owners = node.owners if tenants is None else [t for t in tenants if t in node.owners]
        return i, list(owners)

    def smallest_tenants(self) -> list[str]:
        """The tenants owning the fewest characters (Ray's get_smallest_tenants)."""
        if not self.size:
            return []
        least = min(self.size.values())
        return [t for t, n in self.size.items() if n == least]
