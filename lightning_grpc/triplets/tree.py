"""The trace tree of a rollout's spans, and the repair of LLM-call spans that lost their place in it.

Children are kept in call order: start time, then sequence id (then the order the spans were given).
A parent id that names no given span becomes a virtual node holding that parent's children; several
top-level nodes hang under one virtual root. Parent links that form a cycle are cut where the cycle is
first met in call order. Only real spans are looked up by id; virtual nodes carry no span.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_grpc import semconv
from lightning_grpc.types import Span

#: The name of the virtual node that stands for a parent span that was not given.
LOST_PARENT = "(lost parent)"
#: The id and name of the virtual node above several top-level nodes.
VIRTUAL_ROOT = "(virtual root)"

_NO_ATTRIBUTES: Mapping[str, Any] = {}


@dataclass(eq=False)
class Node:
    """A span in the tree (``span`` is None for a virtual node)."""

    span_id: str
    name: str
    span: Span | None
    start: int
    end: int
    order: tuple[int, int, int]
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)

    @property
    def is_virtual(self) -> bool:
        return self.span is None

    @property
    def is_llm_call(self) -> bool:
        return self.span is not None and self.name == semconv.SPAN_LLM_CALL

    @property
    def attributes(self) -> Mapping[str, Any]:
        return self.span.attributes if self.span is not None else _NO_ATTRIBUTES

    @property
    def has_times(self) -> bool:
        return self.start > 0 and self.end >= self.start

    def ancestors(self) -> Iterator[Node]:
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def walk(self) -> Iterator[Node]:
        """This node and all below it, pre-order, children in call order."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def adopt(self, child: Node) -> None:
        """Make ``child`` a child of this node (taking it from its old parent), keeping call order."""
        if child.parent is not None:
            child.parent.children.remove(child)
        child.parent = self
        bisect.insort(self.children, child, key=lambda node: node.order)


def node_of(span: Span, position: int) -> Node:
    return Node(
        span_id=span.span_id,
        name=span.name,
        span=span,
        start=int(span.start_time_unix_nano or 0),
        end=int(span.end_time_unix_nano or 0),
        order=(int(span.start_time_unix_nano or 0), int(span.sequence_id or 0), position),
    )


def virtual_node(span_id: str, name: str, children: list[Node]) -> Node:
    """A node standing for no span, spanning its children's times."""
    timed = [child for child in children if child.has_times]
    node = Node(
        span_id=span_id,
        name=name,
        span=None,
        start=min((child.start for child in timed), default=0),
        end=max((child.end for child in timed), default=0),
        order=children[0].order,
        children=list(children),
    )
    for child in children:
        child.parent = node
    return node


@dataclass(eq=False)
class TraceTree:
    """The spans of one attempt as a tree. ``root`` is None when there are no spans."""

    root: Node | None
    #: Real spans by id.
    nodes: dict[str, Node]
    #: Spans whose id was already given (the first copy is the one in the tree).
    repeated: list[Span] = field(default_factory=list)

    @classmethod
    def from_spans(cls, spans: Sequence[Span]) -> TraceTree:
        nodes: dict[str, Node] = {}
        repeated: list[Span] = []
        for position, span in enumerate(spans):
            if span.span_id in nodes:
                repeated.append(span)
            else:
                nodes[span.span_id] = node_of(span, position)
        in_order = sorted(nodes.values(), key=lambda node: node.order)
        tops: list[Node] = []
        lost: dict[str, list[Node]] = {}
        for node in in_order:
            parent_id = node.span.parent_span_id if node.span is not None else ""
            if not parent_id or parent_id == node.span_id:
                tops.append(node)
            elif parent_id in nodes:
                parent = nodes[parent_id]
                node.parent = parent
                parent.children.append(node)
            else:
                lost.setdefault(parent_id, []).append(node)
        tops.extend(cut_cycles(in_order, tops, lost))
        tops.extend(virtual_node(parent_id, LOST_PARENT, children) for parent_id, children in lost.items())
        tops.sort(key=lambda node: node.order)
        return cls(root=root_above(tops), nodes=nodes, repeated=repeated)

    def walk(self) -> Iterator[Node]:
        return self.root.walk() if self.root is not None else iter(())

    def release(self) -> None:
        """Cut every parent and child link. A node and its parent refer to each other, so a tree dropped whole
        waits for Python's cyclic garbage collector; a released one is freed at once. The Trainer builds a tree
        for every finished rollout: left to the collector, they paused the server for 30-60 ms every few
        seconds of a training run."""
        for node in [*self.walk(), *self.nodes.values()]:
            node.parent = None
            node.children = []

    def llm_calls(self) -> list[Node]:
        """The LLM-call spans, in call order."""
        return sorted((node for node in self.nodes.values() if node.is_llm_call), key=lambda node: node.order)

    def repair_orphan_calls(self) -> list[Node]:
        """Place each LLM-call span without a known parent under the tightest span enclosing it in time.

        Candidates are real spans other than LLM calls, with both times set and not below the call;
        the tightest has the least slack ``(end - call.end) + (call.start - start)``, then the deepest,
        then the latest in call order. Calls without times, or with no enclosing span, stay. Returns the
        calls moved.
        """
        orphans = [node for node in self.llm_calls() if is_orphan(node) and node.has_times]
        if not orphans:
            return []
        depth = {id(node): level for node, level in walk_with_depth(self.root)}
        candidates = sorted(
            (
                node
                for node in self.nodes.values()
                if not node.is_llm_call and node.has_times and id(node) in depth
            ),
            key=lambda node: node.order,
        )
        if not candidates:
            return []
        starts = np.array([node.start for node in candidates], dtype=np.int64)
        ends = np.array([node.end for node in candidates], dtype=np.int64)
        depths = np.array([depth[id(node)] for node in candidates], dtype=np.int64)
        call_rank = np.arange(len(candidates), dtype=np.int64)
        index_of = {id(node): i for i, node in enumerate(candidates)}
        moved: list[Node] = []
        for orphan in orphans:
            allowed = (starts <= orphan.start) & (ends >= orphan.end)
            for below in orphan.walk():  # never under itself or its own descendants (no cycles)
                if id(below) in index_of:
                    allowed[index_of[id(below)]] = False
            if not allowed.any():
                continue
            slack = (ends - orphan.end) + (orphan.start - starts)
            indices = np.flatnonzero(allowed)
            best = indices[np.lexsort((-call_rank[indices], -depths[indices], slack[indices]))[0]]
            self.move(orphan, candidates[int(best)])
            moved.append(orphan)
        return moved

    def move(self, node: Node, new_parent: Node) -> None:
        old_parent = node.parent
        new_parent.adopt(node)
        if old_parent is not None and old_parent.is_virtual and not old_parent.children:
            if old_parent.parent is not None:
                old_parent.parent.children.remove(old_parent)
            old_parent.parent = None
        root = self.root
        if root is not None and root.is_virtual and root.span_id == VIRTUAL_ROOT and len(root.children) == 1:
            self.root = root.children[0]
            self.root.parent = None


def is_orphan(node: Node) -> bool:
    """Whether a node hangs at the top, or under a virtual node (its parent is not known)."""
    return node.parent is None or node.parent.is_virtual


def root_above(tops: list[Node]) -> Node | None:
    if not tops:
        return None
    if len(tops) == 1:
        return tops[0]
    return virtual_node(VIRTUAL_ROOT, VIRTUAL_ROOT, tops)


def cut_cycles(in_order: list[Node], tops: list[Node], lost: Mapping[str, list[Node]]) -> list[Node]:
    """Nodes on parent cycles are unreachable from the tops: cut each cycle at its first node in call
    order, which becomes a top. Returns the new tops."""
    reached: set[int] = set()
    for start in [*tops, *(node for children in lost.values() for node in children)]:
        reached.update(id(node) for node in start.walk())
    new_tops: list[Node] = []
    for node in in_order:
        if id(node) in reached:
            continue
        if node.parent is not None:
            node.parent.children.remove(node)
            node.parent = None
        new_tops.append(node)
        reached.update(id(below) for below in node.walk())
    return new_tops


def walk_with_depth(root: Node | None) -> Iterator[tuple[Node, int]]:
    if root is None:
        return
    stack = [(root, 0)]
    while stack:
        node, level = stack.pop()
        yield node, level
        stack.extend((child, level + 1) for child in reversed(node.children))
