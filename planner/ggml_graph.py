"""A miniature ggml: the tensors of a compute graph (shapes, sources, views) and a replica of ggml-alloc.

llama.cpp sizes each device's compute buffer by running ggml-alloc over the worst-case graph (sched_reserve in
src/llama-context.cpp). The buffer is the highest address the allocator ever reaches, not the largest set of
tensors alive at once: its best-fit free list fragments (a tiny MoE layer needs 20-40% more than its live set).
So instead of summing live sets we replay the allocator on the same graph, in the same node order.

Sources (the version vendored in llama-cpp-python 0.3.36):
- ggml/src/ggml.c ggml_visit_parents_graph: node order is a depth-first walk from each expanded tensor, sources
  in order src[0], src[1], ...; tensors with op NONE become leafs, everything else a node.
- ggml/src/ggml-alloc.c ggml_gallocr_alloc_graph_impl: leafs first (inputs), then per node: allocate it
  (in place into a source when the op allows it, the source is its own non-view allocation with one consumer
  and no views, same layout, not an output), then release every source whose consumers and views are done.
  ggml_dyn_tallocr_alloc: best fit among the free blocks but the last, else the last block (which grows the
  buffer); sizes rounded up to the buffer type's alignment; frees merge with neighbours.
- ggml/src/ggml-backend.cpp ggml_backend_sched_split_graph: with several devices, nodes run where their
  weight is (op offload: a host weight's op runs on the first GPU when its batch is large enough), the rest
  follow their neighbours (the four expand passes); every split copies the tensors it needs from another
  device into its own buffer at the start of the split (one copy per tensor and device); the source stays
  allocated up to that point (an input_dep node consumes it there).

Shapes are ggml's ne (ne0 first). Weights and KV cache tensors are external: never allocated here.
"""
from __future__ import annotations

from collections.abc import Callable

from .ggml_types import by_name

ESIZE = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8}

# ggml-alloc.c ggml_op_can_inplace (UNARY covers silu, sigmoid, gelu, ...)
INPLACE_OPS = frozenset({
    "FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL", "DIV", "SQR", "SQRT",
    "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM", "RMS_NORM_BACK", "CLAMP", "SOFT_MAX",
    "SOFT_MAX_BACK",
})
VIEW_OPS = frozenset({"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})

INPUT, OUTPUT = 1, 2


class GT:
    """One ggml tensor. `ext` names an external tensor (a weight, or "kv:<layer>" for a KV cache view root);
    `view_src` is the tensor a view aliases (views are never allocated)."""
    __slots__ = ("name", "ne", "dtype", "op", "src", "view_src", "flags", "ext", "nbytes", "contig")

    def __init__(self, name: str, ne: tuple[int, ...], dtype: str, op: str = "NONE", src: tuple = (),
                 view_src: GT | None = None, ext: str | None = None, contig: bool = True,
                 nbytes: int | None = None) -> None:
        self.name = name
        self.ne = tuple(ne) + (1,) * (4 - len(ne))
        self.dtype = dtype
        self.op = op
        self.src = src
        self.view_src = view_src
        self.flags = 0
        self.ext = ext
        self.contig = contig
        if nbytes is None:
            rows = self.ne[1] * self.ne[2] * self.ne[3]
            esize = ESIZE.get(dtype)
            nbytes = rows * (self.ne[0] * esize if esize else by_name(dtype.upper()).row_bytes(self.ne[0]))
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"GT({self.name}, {self.ne}, {self.dtype}, {self.op})"


class Graph:
    """A cgraph under construction: ops create tensors, expand() appends them in ggml's depth-first order."""

    def __init__(self) -> None:
        self.nodes: list[GT] = []
        self.leafs: list[GT] = []
        self._seen: set[int] = set()

    # ---- graph order (ggml_visit_parents_graph) ----

    def expand(self, t: GT) -> GT:
        stack: list[tuple[GT, int]] = [(t, 0)]
        seen = self._seen
        if id(t) in seen:
            return t
        seen.add(id(t))
        while stack:
            node, i = stack[-1]
            if i < len(node.src):
                stack[-1] = (node, i + 1)
                s = node.src[i]
                if s is not None and id(s) not in seen:
                    seen.add(id(s))
                    stack.append((s, 0))
                continue
            stack.pop()
            if node.ext is not None:
                continue            # weights and caches: leafs with data, nothing to allocate
            if node.op == "NONE":
                self.leafs.append(node)
            else:
                self.nodes.append(node)
        return t

    # ---- tensors ----

    @staticmethod
    def weight(name: str, ne: tuple[int, ...], nbytes: int, ext: str | None = None) -> GT:
        return GT(name, ne, "weight", ext=ext or name, nbytes=nbytes)

    @staticmethod
    def input(name: str, ne: tuple[int, ...], dtype: str) -> GT:
        t = GT(name, ne, dtype)
        t.flags |= INPUT
        return t

    # ---- views (ggml_view_*, ggml_reshape_*, ggml_permute, ggml_transpose) ----

    @staticmethod
    def _root(a: GT) -> GT:
        return a.view_src if a.view_src is not None else a

    def view(self, a: GT, ne: tuple[int, ...], op: str = "VIEW", contig: bool = False) -> GT:
        return GT(a.name + "(v)", ne, a.dtype, op, (a,), view_src=self._root(a), contig=contig)

    def reshape(self, a: GT, ne: tuple[int, ...]) -> GT:
        return GT(a.name + "(r)", ne, a.dtype, "RESHAPE", (a,), view_src=self._root(a), contig=a.contig)

    def permute(self, a: GT, axes: tuple[int, int, int, int]) -> GT:
        ne = [0, 0, 0, 0]
        for i, ax in enumerate(axes):
            ne[ax] = a.ne[i]
        return GT(a.name + "(p)", tuple(ne), a.dtype, "PERMUTE", (a,), view_src=self._root(a), contig=False)

    def transpose(self, a: GT) -> GT:
        return GT(a.name + "(t)", (a.ne[1], a.ne[0], a.ne[2], a.ne[3]), a.dtype, "TRANSPOSE", (a,),
                  view_src=self._root(a), contig=False)

    # ---- ops (ggml.c: result shapes and source order) ----

    @staticmethod
    def op(op: str, ne: tuple[int, ...], dtype: str, *src: GT | None, name: str = "") -> GT:
        return GT(name or op.lower(), ne, dtype, op, tuple(src))

    def mul_mat(self, w: GT, x: GT, name: str = "") -> GT:
        return self.op("MUL_MAT", (w.ne[1], x.ne[1], x.ne[2], x.ne[3]), "f32", w, x, name=name)

    def mul_mat_id(self, w: GT, x: GT, ids: GT, name: str = "") -> GT:
        return self.op("MUL_MAT_ID", (w.ne[1], ids.ne[0], x.ne[2], 1), "f32", w, x, ids, name=name)

    def get_rows(self, a: GT, ids: GT, name: str = "") -> GT:
        dtype = "i32" if a.dtype == "i32" else "f32"
        return self.op("GET_ROWS", (a.ne[0], ids.ne[0], ids.ne[1], ids.ne[2]), dtype, a, ids, name=name)

    def unary(self, op: str, a: GT, *src: GT | None, name: str = "") -> GT:
        """Element-wise op with a's shape (RMS_NORM, ROPE, SOFT_MAX, UNARY, SCALE, CLAMP, ...)."""
        return self.op(op, a.ne, "f32", a, *src, name=name)

    def binary(self, op: str, a: GT, b: GT | None, *more: GT | None, name: str = "") -> GT:
        """ADD / MUL / DIV / ADD_ID / GLU ...: result has a's shape."""
        return self.op(op, a.ne, "f32", a, b, *more, name=name)

    def cont(self, a: GT, ne: tuple[int, ...] | None = None, name: str = "") -> GT:
        return self.op("CONT", ne or a.ne, a.dtype, a, name=name)

    def cpy(self, a: GT, dst: GT) -> GT:
        """ggml_cpy(a, dst): a view of dst (a view of the KV cache) that a is copied into; nothing allocated."""
        return GT(dst.name + "(cpy)", dst.ne, dst.dtype, "CPY", (a, dst), view_src=self._root(dst))

    def cast(self, a: GT, dtype: str, name: str = "") -> GT:
        """ggml_cast: a new tensor of a's shape in another type (op CPY; ggml also lists the result as its own
        src[1], which changes nothing in ggml-alloc: it counts as one more child, released by the node itself)."""
        return self.op("CPY", a.ne, dtype, a, name=name or a.name + "_cast")

    def set_rows(self, cache: GT, x: GT, idxs: GT) -> GT:
        """Store into the KV cache: a view of the (external) cache, so nothing is allocated."""
        return GT(cache.name + "(set)", cache.ne, cache.dtype, "SET_ROWS", (cache, x, idxs), view_src=cache)


# ---- ggml-alloc replica ---------------------------------------------------------------------------------------

class DynAllocator:
    """ggml_dyn_tallocr with one chunk (CPU and CUDA buffer types report no maximum size)."""
    __slots__ = ("alignment", "blocks", "max_size")
    _END = 1 << 62

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.blocks: list[list[int]] = [[0, self._END]]   # [offset, size], sorted; the last block is the end
        self.max_size = 0

    def _align(self, size: int) -> int:
        a = self.alignment
        return (size + a - 1) // a * a

    def alloc(self, size: int) -> int:
        size = self._align(size)
        blocks = self.blocks
        best, best_size = -1, self._END
        for i in range(len(blocks) - 1):          # best fit among all but the last block; ties -> the later one
            bs = blocks[i][1]
            if bs >= size and bs <= best_size:
                best, best_size = i, bs
        if best < 0:
            best = len(blocks) - 1
        block = blocks[best]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del blocks[best]
        if offset + size > self.max_size:
            self.max_size = offset + size
        return offset

    def free(self, offset: int, size: int) -> None:
        size = self._align(size)
        blocks = self.blocks
        for i, block in enumerate(blocks):
            if block[0] + block[1] == offset:        # the freed range follows this block
                block[1] += size
                if i + 1 < len(blocks) and block[0] + block[1] == blocks[i + 1][0]:
                    block[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if offset + size == block[0]:            # the freed range precedes this block
                block[0] = offset
                block[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == block[0]:
                    blocks[i - 1][1] += block[1]
                    del blocks[i]
                return
        j = 0
        while j < len(blocks) and blocks[j][0] < offset:
            j += 1
        blocks.insert(j, [offset, size])


class Compiled:
    """A graph as flat integer arrays, for replaying the allocator fast and often.

    Tensor i: nbytes[i]; src[i] (tensor indices); root[i] = the tensor a view aliases (-1: not a view); kind[i]
    0 allocatable, 1 view, 2 external (weight or KV cache: never allocated); layout[i] (equal ids: same shape
    and type, contiguous); inplace[i] (the op may reuse a source); output[i]. leafs and nodes: graph order.
    Callers may append tensors (split-input copies) with add()."""

    def __init__(self, graph: Graph) -> None:
        self.tensors: list[GT] = []
        self.index: dict[int, int] = {}
        self.nbytes: list[int] = []
        self.src: list[tuple[int, ...]] = []
        self.root: list[int] = []
        self.kind: list[int] = []
        self.layout: list[int] = []
        self.inplace: list[bool] = []
        self.output: list[bool] = []
        self.is_view_op: list[bool] = []
        self._layouts: dict[tuple, int] = {}
        self.leafs = [self._idx(t) for t in graph.leafs]
        self.nodes = [self._idx(t) for t in graph.nodes]

    def _idx(self, t: GT) -> int:
        i = self.index.get(id(t))
        if i is not None:
            return i
        srcs = tuple(self._idx(s) for s in t.src if s is not None)
        root = self._idx(t.view_src) if t.view_src is not None else -1
        return self.add(t, srcs, root)

    def add(self, t: GT, srcs: tuple[int, ...], root: int) -> int:
        i = len(self.tensors)
        self.index[id(t)] = i
        self.tensors.append(t)
        self.nbytes.append(t.nbytes)
        self.src.append(srcs)
        self.root.append(root)
        self.kind.append(2 if t.ext is not None else (1 if t.view_src is not None else 0))
        key = (t.ne, t.dtype) if t.contig else ("nc", i)
        self.layout.append(self._layouts.setdefault(key, len(self._layouts)))
        self.inplace.append(t.op in INPLACE_OPS)
        self.output.append(bool(t.flags & OUTPUT))
        self.is_view_op.append(t.op in VIEW_OPS)
        return i


def allocate_compiled(c: Compiled, leafs: list[int], nodes: list[int], dev: list[str],
                      alignment: Callable[[str], int], src: list[tuple[int, ...]] | None = None) -> dict[str, int]:
    """ggml_gallocr_alloc_graph_impl over tensor indices: peak bytes per device. dev[i] is tensor i's device;
    src (default c.src) may rewire sources (split-input copies)."""
    src = src or c.src
    n = len(c.tensors)
    nbytes, root, kind, layout, inplace, output = c.nbytes, c.root, c.kind, c.layout, c.inplace, c.output
    allocs: dict[str, DynAllocator] = {}
    off = [-1] * n                   # offset while allocated by us, -1 otherwise
    children = [0] * n
    views = [0] * n

    def alloc(t: int) -> None:
        if kind[t] or off[t] >= 0:
            return
        if inplace[t]:
            for p in src[t]:
                if (kind[p] == 0 and off[p] >= 0 and not output[p] and layout[p] == layout[t]
                        and children[p] == 1 and views[p] == 0):
                    off[t] = off[p]          # reuse the parent's memory; the parent is not freed
                    off[p] = -1
                    return
        d = dev[t]
        a = allocs.get(d)
        if a is None:
            a = allocs[d] = DynAllocator(alignment(d))
        off[t] = a.alloc(nbytes[t])

    def release(t: int) -> None:
        if output[t] or off[t] < 0:
            return
        allocs[dev[t]].free(off[t], nbytes[t])
        off[t] = -1

    for t in leafs:
        alloc(t)
    for t in nodes:
        r = root[t]
        if r >= 0 and c.tensors[t].op != "NONE":
            views[r] += 1
        for p in src[t]:
            children[p] += 1
    for t in nodes:
        alloc(t)
        for p in src[t]:
            k = children[p] - 1
            children[p] = k
            if k == 0 and views[p] == 0:
                r = root[p]
                if r >= 0:
                    views[r] -= 1
                    if views[r] == 0 and children[r] == 0:
                        release(r)
                else:
                    release(p)
    return {d: a.max_size for d, a in allocs.items()}
