"""Host-side argument checks: a clear ValueError naming the argument, before any launch."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

KV_DTYPES = ("float32", "float16", "bfloat16")
FP8 = ("float8_e4m3fn", "float8_e5m2")
SCALE_MODES = ("per-tensor", "per-head", "per-token")


def dtype_label(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, tensor, *, ndim: int | None = None, shape: tuple | None = None,
                 dtype=None, float32: bool = False, int32: bool = False, device=None) -> None:
    """Raise ValueError naming ``name`` when the tensor is not what the kernel needs."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype_label(dtype)}, got "
                         f"{dtype_label(tensor.dtype)}")
    if float32 and tensor.dtype != torch.float32:
        raise ValueError(f"{name}: expected dtype float32, got {dtype_label(tensor.dtype)}")
    if int32 and tensor.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype int32, got {dtype_label(tensor.dtype)}")
    if dtype_label(tensor.dtype) not in (*KV_DTYPES, *FP8, "int32"):
        raise ValueError(f"{name}: dtype {dtype_label(tensor.dtype)} is not supported "
                         f"(one of {', '.join((*KV_DTYPES, *FP8))})")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (strides {tensor.stride()})")


def check_paged_inputs(q, k_pages, v_pages, block_table, context_lens, *,
                       window: int | None, sinks: int, out_dtype=None,
                       scales: Scales | None = None,
                       queries: Queries | None = None) -> tuple[int, ...]:
    """Checks shared by the paged kernels; returns (batch, qo heads, kv heads, dim, page size).
    ``out_dtype`` is q's unless q is fp8; K and V are in it unless ``scales`` say fp8; q has
    one row per sequence unless ``queries`` packs several."""
    check_tensor("q", q, ndim=3)
    batch, num_qo_heads, head_dim = q.shape
    if queries is not None:
        check_tensor("context_lens", context_lens, ndim=1, int32=True, device=q.device)
        batch = context_lens.shape[0]
    scales = scales or Scales()
    quantized_q = dtype_label(q.dtype) in FP8
    if quantized_q and scales.q_scale is None:
        raise ValueError(f"q: dtype {dtype_label(q.dtype)} needs a q_scale")
    compute = out_dtype if quantized_q and out_dtype is not None else q.dtype
    kv_dtype = k_pages.dtype if scales.kv_scale is not None else compute
    check_tensor("k_pages", k_pages, ndim=4, dtype=kv_dtype, device=q.device)
    num_pages, page_size, num_kv_heads, k_dim = k_pages.shape
    if k_dim != head_dim:
        raise ValueError(f"k_pages: head_dim {k_dim} does not match q's head_dim {head_dim}")
    check_tensor("v_pages", v_pages, shape=tuple(k_pages.shape), dtype=kv_dtype,
                 device=q.device)
    scales.check(q, k_pages)
    if num_kv_heads == 0 or num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if head_dim < 1 or head_dim > 512:
        raise ValueError(f"head_dim: {head_dim} is outside 1..512")
    check_table(block_table, context_lens, batch, num_pages, page_size, q.device,
                window=window, sinks=sinks)
    if queries is not None:
        queries.check(q, context_lens)
    return batch, num_qo_heads, num_kv_heads, head_dim, page_size


def check_table(block_table, context_lens, batch: int, num_pages: int, page_size: int,
                device, *, window: int | None, sinks: int) -> None:
    """The block table, the context lengths, the window and sinks, against a pool of
    ``num_pages`` pages of ``page_size``."""
    check_tensor("block_table", block_table, ndim=2, int32=True, device=device)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table: {block_table.shape[0]} rows for a batch of {batch}")
    check_tensor("context_lens", context_lens, shape=(batch,), int32=True, device=device)
    if page_size < 1:
        raise ValueError(f"page_size: {page_size} must be at least 1")
    if batch:
        # one read back from the device for the four bounds (a read each cost a sync each)
        import torch

        table = block_table if block_table.numel() else torch.full(
            (1,), -1, dtype=torch.int32, device=block_table.device)
        top, bottom, longest, shortest = (int(x) for x in torch.stack(
            [table.max(), table.min(), context_lens.max(), context_lens.min()]).tolist())
        if top >= num_pages:
            raise ValueError(f"block_table: block id {top} is past the pool of {num_pages} pages")
        if bottom < -1:
            raise ValueError(f"block_table: block id {bottom} is below -1")
        if shortest < 0:
            raise ValueError(f"context_lens: negative length {shortest}")
        if longest > block_table.shape[1] * page_size:
            raise ValueError(f"context_lens: {longest} tokens do not fit {block_table.shape[1]} "
                             f"blocks of {page_size}")
    if window is not None and window < 1:
        raise ValueError(f"window: {window} must be at least 1")
    if sinks < 0:
        raise ValueError(f"sinks: {sinks} must not be negative")


def check_mla_inputs(q, pages, block_table, context_lens, out, lse, *, kv_lora_rank: int,
                     window: int | None, sinks: int) -> None:
    """An MLA launch: ``q (batch, heads, kv_lora_rank + rope_dim)``, ``pages (pages,
    page_size, 1, same width)`` in q's dtype, ``out (batch, heads, kv_lora_rank)``."""
    check_tensor("q", q, ndim=3)
    batch, heads, width = q.shape
    if dtype_label(q.dtype) not in KV_DTYPES:
        raise ValueError(f"q: dtype {dtype_label(q.dtype)}; want one of {', '.join(KV_DTYPES)}")
    if not 0 < kv_lora_rank < width:
        raise ValueError(f"kv_lora_rank: {kv_lora_rank}, want 0 < kv_lora_rank < q's width "
                         f"{width} (the latent, then the rotary part)")
    check_tensor("pages", pages, ndim=4, dtype=q.dtype, device=q.device)
    if pages.shape[2:] != (1, width):
        raise ValueError(f"pages: want (pages, page_size, 1, {width}), got shape "
                         f"{tuple(pages.shape)}")
    check_table(block_table, context_lens, batch, pages.shape[0], pages.shape[1], q.device,
                window=window, sinks=sinks)
    check_tensor("out", out, shape=(batch, heads, kv_lora_rank), dtype=q.dtype,
                 device=q.device)
    check_tensor("lse", lse, shape=(batch, heads), float32=True, device=q.device)


def check_output_buffers(q, out, lse) -> None:
    if dtype_label(q.dtype) in FP8:  # an fp8 query: the output in a 16- or 32-bit dtype
        check_tensor("out", out, shape=tuple(q.shape), device=q.device)
        if dtype_label(out.dtype) not in KV_DTYPES:
            raise ValueError(f"out: dtype {dtype_label(out.dtype)} for an fp8 query; want one "
                             f"of {', '.join(KV_DTYPES)}")
    else:
        check_tensor("out", out, shape=tuple(q.shape), dtype=q.dtype, device=q.device)
    check_tensor("lse", lse, shape=tuple(q.shape[:2]), float32=True, device=q.device)


@dataclass(frozen=True)
class Scales:
    """An fp8 cache's scales (``kv_scale``: the layout, float32 tensors ``k_scale`` and
    ``v_scale`` of shape (1,), (kv_heads,) or (pages, page_size, kv_heads)) and an fp8
    query's ``q_scale`` (1,); None where that input is not quantized."""

    kv_scale: str | None = None
    k_scale: object = None
    v_scale: object = None
    q_scale: object = None

    def check(self, q, k_pages) -> None:
        if self.kv_scale is None:
            if self.k_scale is not None or self.v_scale is not None:
                raise ValueError("k_scale: given without kv_scale (the scales' layout)")
        else:
            if self.kv_scale not in SCALE_MODES:
                raise ValueError(f"kv_scale: {self.kv_scale!r} is not one of "
                                 f"{', '.join(SCALE_MODES)}")
            if dtype_label(k_pages.dtype) not in FP8:
                raise ValueError(f"k_pages: dtype {dtype_label(k_pages.dtype)} with kv_scale "
                                 f"{self.kv_scale!r}; want one of {', '.join(FP8)}")
            pages, page_size, kv_heads, _ = k_pages.shape
            shape = {"per-tensor": (1,), "per-head": (kv_heads,),
                     "per-token": (pages, page_size, kv_heads)}[self.kv_scale]
            for name in ("k_scale", "v_scale"):
                check_tensor(name, getattr(self, name), shape=shape, float32=True,
                             device=q.device)
        if self.q_scale is not None:
            if dtype_label(q.dtype) not in FP8:
                raise ValueError(f"q_scale: given for a q of dtype {dtype_label(q.dtype)}")
            check_tensor("q_scale", self.q_scale, shape=(1,), float32=True, device=q.device)


@dataclass(frozen=True)
class Queries:
    """Several query tokens per sequence, packed: sequence ``b``'s are rows
    ``query_start[b]:query_start[b + 1]`` of q (``(batch + 1,)`` int32, from 0), its last
    positions; ``draft_mask`` ``(tokens, max_query_len)`` bool: row r sees draft j of its
    sequence, or None (causal: draft t sees drafts 0..t). ``max_query_len`` is the longest
    (a host value: it sizes the tile)."""

    query_start: object
    max_query_len: int
    draft_mask: object = None

    def check(self, q, context_lens) -> None:
        import torch

        batch, tokens = context_lens.shape[0], q.shape[0]
        check_tensor("query_start", self.query_start, shape=(batch + 1,), int32=True,
                     device=q.device)
        both = torch.cat([self.query_start, context_lens.to(self.query_start.dtype)]).tolist()
        starts, context = both[:batch + 1], both[batch + 1:]  # one read back, not two
        lens = [b - a for a, b in pairwise(starts)]
        if starts[0] != 0 or starts[-1] != tokens:
            raise ValueError(f"query_start: runs from {starts[0]} to {starts[-1]}; want 0 to "
                             f"q's {tokens} rows")
        for b, (length, n) in enumerate(zip(lens, context, strict=True)):
            if not 1 <= length <= n:
                raise ValueError(f"query_start: sequence {b} has {length} query tokens; want "
                                 f"1 to its context length {n} (which counts them)")
        if max(lens, default=0) != self.max_query_len:
            raise ValueError(f"max_query_len: {self.max_query_len}, but the longest sequence "
                             f"has {max(lens, default=0)} query tokens")
        if self.draft_mask is not None:
            mask = self.draft_mask
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise ValueError("draft_mask: expected a torch.bool tensor")
            if mask.dim() != 2 or mask.shape[0] != tokens or mask.shape[1] < self.max_query_len:
                raise ValueError(f"draft_mask: shape {tuple(mask.shape)}; want ({tokens}, at "
                                 f"least {self.max_query_len})")
            if mask.device != q.device or not mask.is_contiguous():
                raise ValueError(f"draft_mask: must be contiguous on {q.device}")


@dataclass(frozen=True)
class ScoreModifiers:
    """What a model does to the scores: ``soft_cap`` (a float: cap * tanh(s / cap)),
    ``sink_logits`` and ``alibi_slopes`` (float32 tensors, one per query head); None where
    absent."""

    soft_cap: float | None = None
    sink_logits: object = None
    alibi_slopes: object = None

    def check(self, num_qo_heads: int, device) -> None:
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"soft_cap: {self.soft_cap} must be positive")
        for name in ("sink_logits", "alibi_slopes"):
            if getattr(self, name) is not None:
                check_tensor(name, getattr(self, name), shape=(num_qo_heads,), float32=True,
                             device=device)


def paged_shapes(q, k_pages, v_pages, block_table, context_lens, out, lse, *,
                 window: int | None, sinks: int, validate: bool,
                 scales: Scales | None = None, queries: Queries | None = None
                 ) -> tuple[int, ...]:
    """(batch, qo heads, kv heads, head dim, page size), every argument checked first unless
    ``validate`` is off (the benchmarked launch, after one checked call)."""
    if not validate:
        return context_lens.shape[0], q.shape[1], k_pages.shape[2], q.shape[2], \
            k_pages.shape[1]
    shapes = check_paged_inputs(q, k_pages, v_pages, block_table, context_lens, window=window,
                                sinks=sinks, out_dtype=out.dtype, scales=scales,
                                queries=queries)
    check_output_buffers(q, out, lse)
    return shapes
