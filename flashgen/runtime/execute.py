"""Executing a plan: tensors in the layouts the kernels read, Params packing and launching on the
current stream, the split-KV combine, and the launch records that repeated calls replay.
interface.py, backward.py and kvcache.py call it; it calls none of them."""
from __future__ import annotations

import contextlib
import functools
import struct
import typing

import torch

from ..generator import matrix
from ..generator import params as params_mod
from ..generator.spec import KernelSpec
from . import tma, tuning
from .device import device_index, device_info
from .dispatch import FwdPlan
from .dropout import NO_DROPOUT_PARAMS
from .launch import ContextNotCurrent, bind_primary_context, get_kernel

LOG2E = 1.4426950408889634


def whole_chunks(t: torch.Tensor) -> bool:
    """Whether kernels can move t's rows in 16-byte chunks: a contiguous last dim, a 16-byte
    aligned base and strides of whole 8-element chunks."""
    strides = t.stride()  # (on every call: one tuple, no generator)
    if strides[-1] != 1 or t.data_ptr() % 16:
        return False
    for stride in strides[:-1]:
        if stride % 8:
            return False
    return True


def chunk_aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy in whole 16-byte chunks (whole_chunks). Inputs are validated to have a
    contiguous last dim; dout arrives in whatever layout autograd made (expanded from a sum,
    interleaved from a stack, ...). A copy also where t is contiguous but starts off a 16-byte
    boundary (a view at an odd offset), which ``contiguous()`` would hand back as it is."""
    return t if whole_chunks(t) else t.clone(memory_format=torch.contiguous_format)


# The kernels move rows in whole 16-byte chunks (8 fp16/bf16 elements). As in flash_attn 2, a call
# whose head dim is not a multiple of 8 runs on copies padded with zero columns, which change no
# score and give zero output columns, and its outputs are sliced back; autograd carries the
# gradients through the pad and the slice. A head dim that is a multiple of 8 skips all of it.
HEAD_DIM_MULTIPLE = 8


def pad_head_dim(x: torch.Tensor, multiple: int = HEAD_DIM_MULTIPLE) -> torch.Tensor:
    """x with zero columns appended to its last dimension up to a multiple of ``multiple``; x itself
    when it is one."""
    extra = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


_COMBINE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def launch_kernel(spec, smem_bytes: int, num_threads: int, grid, params: bytes, index: int,
            dependent: bool = False, cluster: tuple[int, int, int] | None = None) -> None:
    """Launch on the current stream; ``dependent``: as a programmatic dependent launch (see
    LoadedKernel.launch_dependent; the kernel must wait with griddepcontrol.wait); ``cluster``: in
    thread-block clusters of that shape (sm_90+)."""
    kernel = get_kernel(spec, smem_bytes, num_threads)
    launch = kernel.launch_dependent if dependent else kernel.launch
    if cluster is not None:
        launch = functools.partial(kernel.launch_cluster, cluster=cluster, dependent=dependent)
    if torch.cuda.current_device() != index:
        with torch.cuda.device(index):
            _prepare_and_launch(kernel, launch, grid, params, index)
    else:
        _prepare_and_launch(kernel, launch, grid, params, index)


def _prepare_and_launch(kernel, launch, grid, params: bytes, index: int) -> None:
    kernel.prepare(index)
    try:
        launch(grid, stream_handle(index), params)
    except ContextNotCurrent:  # a thread's first launch before any of PyTorch's: bind and retry
        bind_primary_context(index)
        launch(grid, stream_handle(index), params)


# The current stream's handle, without building a torch.cuda.Stream object (a few microseconds per
# launch): the raw getter CUDA builds of torch have, else the public API.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


@functools.lru_cache(maxsize=64)
def combine_spec(capability: tuple[int, int], dtype: torch.dtype) -> KernelSpec:
    arch = matrix.target_arch(*capability)
    return KernelSpec("combine", matrix.family_for(arch), arch, _COMBINE_DTYPES[dtype])


@functools.lru_cache(maxsize=256)
def combine_geometry(num_splits: int, rows: int, head_dim: int, num_sms: int):
    """(threads, grid) of a combine launch. templates/combine.cuh derives the rest from the grid;
    any grid is correct. A CTA of `threads` (kCombineThreads) is R rows x G split groups x C column
    threads; the grid sets R, and with it G = threads / (R * C). Each thread has up to 8 partial
    float4s in flight per batch (kCombineLoads): up to 8 splits (its group's share) of one chunk
    when num_splits > 4, else 8 / 2**ceil(log2(splits)) chunks of every split. Pick R so that one
    batch covers the splits (G >= splits / 8), and, when rows are few, so that they spread over the
    SMs: at decode every row then gets a whole CTA and the combine costs about one global round
    trip."""
    threads = 256  # kCombineThreads
    chunks_per_thread = 1 if num_splits > 4 else 8 >> (num_splits - 1).bit_length()  # kKc
    col_threads = min(1 << max(-(-(head_dim // 4) // chunks_per_thread) - 1, 0).bit_length(), 64)  # C
    rows_per_pass = threads // col_threads
    if chunks_per_thread == 1:
        rows_per_pass = max(1, rows_per_pass >> (-(-num_splits // 8) - 1).bit_length())
    rows_per_pass = min(rows_per_pass, 1 << (max(1, rows // num_sms).bit_length() - 1))
    return threads, (max(1, min(-(-rows // rows_per_pass), 2**31 - 1)), 1, 1)


def launch_combine(out_partial, lse_partial, out, lse, *, partial_strides, lse_partial_strides,
                   out_strides, lse_strides, num_splits, batch, seqlen, nheads, head_dim, capture=None) -> None:
    """Merge split-KV partials. Strides are (split, batch, row, head) for partials and
    (batch, row, head) for outputs, in elements. ``capture``: the launch kept there too."""
    index = device_index(out)
    info = device_info(index)
    spec = combine_spec(info.capability, out.dtype)
    pointers = dict(out_partial_ptr=out_partial, lse_partial_ptr=lse_partial, out_ptr=out, lse_ptr=lse)
    values = addresses(pointers)
    values.update(num_splits=num_splits, batch=batch, seqlen=seqlen, nheads=nheads, head_dim=head_dim)
    for prefix, names, strides in (
        ("out_partial", ("split", "batch", "row", "head"), partial_strides),
        ("lse_partial", ("split", "batch", "row", "head"), lse_partial_strides),
        ("out", ("batch", "row", "head"), out_strides),
        ("lse", ("batch", "row", "head"), lse_strides),
    ):
        values.update({f"{prefix}_{n}_stride": st for n, st in zip(names, strides)})
    threads, grid = combine_geometry(num_splits, batch * seqlen * nheads, head_dim, info.num_sms)
    # On sm_90+ the combine is a programmatic dependent launch: its CTAs are resident when the
    # forward's last ones finish (combine.cuh waits with griddepcontrol.wait), hiding its launch.
    params = params_mod.pack(params_mod.COMBINE_LAYOUT, values)
    dependent = tuning.current().dependent_combine and info.capability[0] >= 9
    launch_kernel(spec, 0, threads, grid, params, index, dependent=dependent)
    if capture is not None:
        capture.add(params_mod.COMBINE_LAYOUT, pointers, spec, 0, threads, grid, params, dependent)


def addresses(pointers: dict) -> dict:
    """{field: data pointer (0 for None)} of a launch's {pointer field: tensor or None}: the one
    statement of which tensor a field points to, packed here and kept by a Capture."""
    return {name: t.data_ptr() if t is not None else 0 for name, t in pointers.items()}


def ptr_or_null(t) -> int:
    return t.data_ptr() if t is not None else 0


def row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, head) strides of a dense (batch, seqlen, heads, d) tensor, or of a varlen
    (total, heads, d) one, whose sequences are found through cu_seqlens (batch stride 0)."""
    return t.stride()[:3] if t.dim() == 4 else (0, *t.stride()[:2])


def run_fwd(
    plan: FwdPlan, *, q, k, v, out, lse, softmax_scale, softcap, alibi_slopes, seqlen_k,
    seqused_k=None, seqlen_k_new=0, leftpad_k=None, kv_batch_idx=None, block_table=None,
    page_size=1, kv_batch=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
    dropout=None, max_seqlen_q=None, capture: Capture | None = None,
) -> None:
    """Launch a planned forward (and the split-KV combine) writing ``out`` and ``lse``.

    Dense: q (batch, seqlen_q, nheads, d), lse (batch, nheads, seqlen_q). Varlen (cu_seqlens_q):
    q (total_q, nheads, d), lse (nheads, total_q); ``seqlen_k`` is then the K/V rows (or the paged
    capacity) that reads never pass, and ``max_seqlen_q`` the longest sequence's query rows.
    ``capture``: keep the launches there too, for a record of the call (record_launches)."""
    nheads, head_dim = q.shape[-2], q.shape[-1]
    nheads_k = k.shape[-2]
    if cu_seqlens_q is not None:
        batch, seqlen_q = cu_seqlens_q.shape[0] - 1, q.shape[0]  # seqlen_q: rows of q
        partial_rows = seqlen_q
        lse_strides = (0, 1, seqlen_q)  # (batch, row, head) of (nheads, total_q)
    else:
        batch, seqlen_q = q.shape[0], q.shape[1]
        partial_rows = batch * seqlen_q
        lse_strides = (nheads * seqlen_q, 1, seqlen_q)
    has_softcap = softcap > 0
    splits = plan.num_splits
    if splits > 1 and not plan.merge_in_cluster:
        partials = Scratch(split_partials, (splits * partial_rows * nheads * head_dim, splits * partial_rows * nheads))
        oaccum, lseaccum = partials.make(q.device)
        if seqused_q is not None:
            lseaccum.fill_(-float("inf"))  # rows past seqused_q: no split writes them, the combine gives 0
        if capture is not None:
            capture.scratch = (partials, (oaccum, lseaccum))
    else:
        oaccum = lseaccum = None
    index = device_index(q)
    # An sm90 instance wider than the call (a head dim between two instances) stores all of its
    # columns: into a padded O (zeroed where the kernel writes no rows: past seqused_q), whose
    # call's columns are copied out after the launch. (Its split-KV partials have the call's.)
    padded_out = None
    if plan.spec.head_dim > head_dim and plan.spec.family == "sm90" and splits == 1:
        alloc = torch.empty if seqused_q is None else torch.zeros
        padded_out = alloc((*out.shape[:-1], plan.spec.head_dim), dtype=out.dtype, device=out.device)
    o_tensor = out if padded_out is None else padded_out
    dropping = dropout is not None and dropout.p > 0
    if capture is not None and (padded_out is not None or seqused_q is not None or dropping):
        capture.replayable = False
    pointers = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=o_tensor, lse_ptr=lse, alibi_slopes_ptr=alibi_slopes,
        seqused_k_ptr=seqused_k, leftpad_k_ptr=leftpad_k, kv_batch_idx_ptr=kv_batch_idx, block_table_ptr=block_table,
        oaccum_ptr=oaccum, lseaccum_ptr=lseaccum, cu_seqlens_q_ptr=cu_seqlens_q, cu_seqlens_k_ptr=cu_seqlens_k,
        seqused_q_ptr=seqused_q,
    )
    fwd_params = params_mod.pack_fwd_values(
        **addresses(pointers),
        q_strides=row_strides(q), k_strides=row_strides(k), v_strides=row_strides(v), o_strides=row_strides(o_tensor),
        alibi_batch_stride=alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
        block_table_batch_stride=block_table.stride(0) if block_table is not None else 0,
        lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[2], partial_rows=partial_rows,
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, seqlen_k_new=seqlen_k_new,
        max_seqlen_q=seqlen_q if max_seqlen_q is None else max_seqlen_q,
        kv_batch=kv_batch if kv_batch is not None else (batch if cu_seqlens_k is not None else k.shape[0]),
        num_splits=splits, merge_in_cluster=int(plan.merge_in_cluster),
        nheads=nheads, nheads_k=nheads_k, head_dim=head_dim,
        window_left=plan.window_left, window_right=plan.window_right,
        kv_head_group=plan.kv_head_group, qhead_per_khead=nheads // nheads_k * plan.kv_head_group,
        page_size=page_size,
        scale_log2=LOG2E if has_softcap else softmax_scale * LOG2E,
        softmax_scale=softmax_scale,
        softcap_scale=softmax_scale / softcap if has_softcap else 0.0,
        softcap=float(softcap),
        alibi_scale=1.0 if has_softcap else 1.0 / softmax_scale,
        **(dropout.params() if dropping else NO_DROPOUT_PARAMS),
    )
    cluster = (1, 1, splits) if plan.merge_in_cluster else None
    packed, maps = fwd_params, None
    if plan.spec.family == "sm90":  # the TMA maps of Q, K, V before the FwdParams
        group = nheads // nheads_k if plan.spec.pack_gqa else 1
        block_m, block_n = plan.tile.block_m, plan.tile.block_n
        maps = TensorMaps(lambda q, k, v, params: tma.sm90_fwd_params(q, k, v, block_m, block_n, params, group),
                          (q, k, v))
        packed = maps.prepend(q, k, v, fwd_params)
    launch_kernel(plan.spec, plan.smem_bytes, plan.tile.num_threads, plan.grid, packed, index,
                  dependent=plan.dependent_launch, cluster=cluster)
    if capture is not None:
        capture.add(params_mod.FWD_LAYOUT, pointers, plan.spec, plan.smem_bytes, plan.tile.num_threads, plan.grid,
                    fwd_params, plan.dependent_launch, cluster, maps)
    if padded_out is not None:
        out.copy_(padded_out[..., :head_dim])
    if splits > 1 and not plan.merge_in_cluster:
        # Partials are (split, row, head[, d]) with rows numbered across the batch; the combine
        # sees a varlen call as one sequence of total_q rows.
        row_o, row_lse = nheads * head_dim, nheads
        launch_combine(
            oaccum, lseaccum, out, lse,
            partial_strides=(partial_rows * row_o, seqlen_q * row_o, row_o, head_dim),
            lse_partial_strides=(partial_rows * row_lse, seqlen_q * row_lse, row_lse, 1),
            out_strides=row_strides(out), lse_strides=lse_strides, num_splits=splits,
            batch=batch if cu_seqlens_q is None else 1, seqlen=seqlen_q, nheads=nheads, head_dim=head_dim,
            capture=capture,
        )


def split_partials(o_elems: int, lse_elems: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-KV forward's fp32 partial O and LSE (elements of each), in one allocation (an
    allocation is several microseconds): allocated per call (a Scratch), by run_fwd and by run_record."""
    scratch = torch.empty(o_elems + lse_elems, dtype=torch.float32, device=device)
    return scratch[:o_elems], scratch[o_elems:]


# ---------------------------------------------------------------------------------------------
# Launch records: a repeated call of one description (its caller's key: everything the plans and
# the params depend on but the tensors' addresses) launches what its first call launched, each
# params buffer copied with the new call's pointers written in. The first call runs the full path
# with a Capture, which keeps each launch with the tensors its pointer fields came from;
# record_launches turns those tensors into slots of the caller's tuple of per-call tensors. Used by
# the dense forward (interface._fwd), flash_attn_with_kvcache (kvcache) and the backward (backward).


def described(t):
    """An optional argument's part of a record key: a tensor's shape, strides and dtype; None; or,
    for a number (kvcache's cache_seqlens), that it is one: its value is data, made into a tensor
    per call."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return t.shape, t.stride(), t.dtype
    return "number"


class TensorMaps(typing.NamedTuple):
    """The TMA maps an sm90 kernel reads before its params, made per call from the call's tensors
    (tma memoizes them by address): the launch's params are prepend(*tensors, params).
    ``tensors``: the call's (Capture.add), or their slots in a record's tensors (Launch)."""

    prepend: typing.Callable[..., bytes]
    tensors: tuple


class Scratch(typing.NamedTuple):
    """Buffers a call's kernels need and nobody keeps (split-KV partials, the backward's dQ
    accumulator, ...), allocated per call by the full path and by a record alike:
    allocate(*sizes, device) returns them (None for one the call does without)."""

    allocate: typing.Callable[..., tuple]
    sizes: tuple

    def make(self, device) -> tuple:
        return self.allocate(*self.sizes, device)


class Launch(typing.NamedTuple):
    """One kernel launch of a record: launch_kernel's arguments, params as the recording call
    packed them, and where a later call's pointers go."""

    spec: KernelSpec
    smem_bytes: int
    num_threads: int
    grid: tuple[int, int, int]
    params: bytes
    dependent: bool
    cluster: tuple[int, int, int] | None
    pointers: tuple[tuple[int, int], ...]  # (offset in params, slot in the call's tensors)
    maps: TensorMaps | None  # the sm90 kernels' maps before params (slots of their tensors); None for the rest


class LaunchRecord(typing.NamedTuple):
    """A call's launches (a dense forward; a KV-cache call's append, forward and combine; a
    backward's preprocess, main kernel and postprocess), planned and packed once for the calls of
    one description: run_record launches them again with a call's pointers, after allocating
    its scratch as the full path does."""

    launches: tuple[Launch, ...]
    scratch: Scratch | None  # made per call; its tensors take the slots after the call's


class LaunchRecords(dict):
    """One call site's records ({call description: LaunchRecord}): cleared when full (the
    descriptions one process sees are few); capacity 0 keeps none."""

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = capacity

    def keep(self, key, record: LaunchRecord | None) -> None:
        if record is None or not self.capacity:
            return
        if len(self) >= self.capacity:
            self.clear()
        self[key] = record

    @contextlib.contextmanager
    def off(self):
        """No record read or written inside (the full path, for benchmarks and tests); those kept
        before are kept after."""
        kept, capacity = dict(self), self.capacity
        self.clear()
        self.capacity = 0
        try:
            yield
        finally:
            self.clear()
            self.update(kept)
            self.capacity = capacity


class Capture:
    """What a call that runs the full path launches, kept for a record of it (record_launches):
    each launch with {pointer field: tensor}, added by the code that launches it."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []  # (layout, {field: tensor or None}, Launch without pointers, maps)
        self.scratch: tuple[Scratch, tuple] | None = None  # the call's Scratch and the tensors it made
        # False where the call did what a record does not repeat: more than its launches (a padded O
        # copied out, partials filled) or params of per-call values (dropout's RNG offset).
        self.replayable = True

    def add(self, layout, pointers: dict, spec, smem_bytes: int, num_threads: int, grid, params: bytes,
            dependent: bool = False, cluster=None, maps: TensorMaps | None = None) -> None:
        """A launch_kernel call's arguments (``params``: without the TMA maps that ``maps``, of
        the call's tensors, puts before them)."""
        self.launches.append((layout, pointers, Launch(spec, smem_bytes, num_threads, grid, params, dependent,
                                                       cluster, (), None), maps))


_FIELD_OFFSETS = {id(layout): dict(zip((f.name for f in layout.fields), layout.offsets))
                  for layout in params_mod.LAYOUTS.values()}
_POINTER = struct.Struct("<Q")


def record_launches(capture: Capture, tensors: tuple) -> LaunchRecord | None:
    """A record of the launches ``capture`` kept, for later calls whose tensors come in the order
    of ``tensors`` (this call's; None for an absent one), the scratch after them. None where a
    record would launch something else than the full path: a launch points to a tensor not
    among them (a copy the full path made, a padded O), a tensor sits in two slots (which one a
    later call's pointer comes from would be a guess: a caller that passes one twice must leave
    its later slots None and key calls by it), or the capture is not replayable."""
    if not capture.replayable or not capture.launches:
        return None
    scratch = None
    if capture.scratch is not None:
        scratch, made = capture.scratch
        tensors = (*tensors, *made)
    slots = {}
    for slot, t in enumerate(tensors):
        if t is not None:
            if id(t) in slots:
                return None
            slots[id(t)] = slot
    launches = []
    for layout, pointers, launch, maps in capture.launches:
        offsets = _FIELD_OFFSETS[id(layout)]
        patched = []
        for name, t in pointers.items():
            if t is not None:
                if id(t) not in slots:
                    return None
                patched.append((offsets[name], slots[id(t)]))
        if maps is not None:
            if not all(id(t) in slots for t in maps.tensors):
                return None
            maps = maps._replace(tensors=tuple(slots[id(t)] for t in maps.tensors))
        launches.append(launch._replace(pointers=tuple(patched), maps=maps))
    return LaunchRecord(tuple(launches), scratch)


def patch_pointers(params: bytes, pointers: tuple[tuple[int, int], ...], tensors: tuple) -> bytes:
    """``params`` with the data pointer of tensors[slot] at each (offset, slot) of ``pointers``."""
    buffer = bytearray(params)
    for offset, slot in pointers:
        _POINTER.pack_into(buffer, offset, tensors[slot].data_ptr())
    return bytes(buffer)


def run_record(record: LaunchRecord, tensors: tuple, index: int) -> None:
    """Launch a record for a call of its description: ``tensors`` in the recording call's order
    (tensors[0] on the device the scratch goes to), each where the kernels read it (16-byte
    aligned: the caller checks what its key does not fix). Every params buffer is made before the
    first launch, so that the kernels are enqueued back to back."""
    if record.scratch is not None:
        tensors = (*tensors, *record.scratch.make(tensors[0].device))
    packed = []
    for launch in record.launches:
        params = patch_pointers(launch.params, launch.pointers, tensors)
        if launch.maps is not None:
            params = launch.maps.prepend(*[tensors[slot] for slot in launch.maps.tensors], params)
        packed.append(params)
    for launch, params in zip(record.launches, packed):
        launch_kernel(launch.spec, launch.smem_bytes, launch.num_threads, launch.grid, params, index,
                      dependent=launch.dependent, cluster=launch.cluster)
