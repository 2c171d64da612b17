"""The multi-layer draft-extend prepare as one device launch: the engine's GPU kernel, and the choice of path.

The multi-layer runner fills its shared buffers once per iteration, outside the graphs. Done as
torch ops that fill is some sixteen small launches (the reset of every buffer, the live
copy-ins, the gathered counts), each a host launch before the replays can start. The engine
(SGLang 0.5.16 on) writes the whole fill with one Triton launch on CUDA, and keeps a native torch
twin for devices where the kernel cannot run; the engine under test has the same two paths, so a
bug in either (the engine's native twin has had one: padded token rows left stale) has its place here.
We do the same: `PrepareFill.TRITON` (runners.multi_layer_eagle_draft_extend_cuda_graph_runner) on a CUDA worker launches
`fill_prepare_buffers`; `PrepareFill.NATIVE` everywhere else keeps the runner's torch methods
(reset_for_iteration, _copy_live_inputs), which the CPU suite and the built-in mutants exercise.
This module imports triton, an optional package: the runner imports it on the fused path only. The kernel must leave
every device buffer bitwise as the native path does; tests/test_draft_extend_fill.py holds it to
that (in Triton's interpreter on CPU, and on CUDA).

What it writes, and what it leaves (the native path's values, runners.multi_layer_eagle_draft_extend_cuda_graph_runner):
  input_ids, positions       live rows from the batch, every other row 0
  out_cache_loc              pad.slot in every row (the body writes the bucket's rows itself)
  seq_lens                   live lanes from the batch, every other lane SEQ_LEN_FILL_VALUE
  req_pool_indices           live lanes from the batch, every other lane pad.row (the convention's: runners.memory)
  num_correct_drafts         live lanes accept_len - 1; other lanes keep what they held
  num_accept_tokens          live lanes accept_len; other lanes keep what they held
  hidden_states              live rows from the batch; other rows keep what they held
  global_num_tokens(_for_logprob)_gpu, when the layout has them: bucket * tokens_per_bs
The host mirror seq_lens_cpu is a host tensor: the runner writes it itself, as the native path.
"""
from __future__ import annotations

import torch

from runners.attention.triton_launch import run_kernel, tl, triton
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftExtendInputs
from runners.draft_extend_cuda_graph_runner import DraftExtendInputBuffers
from runners.memory import LanePadding

__all__ = ["fill_prepare_buffers"]

TOKEN_BLOCK = 512
HIDDEN_BLOCK = 4096
# The hidden rows are copied as raw bits: one kernel per element width, and NaN payloads kept as a copy keeps them.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# The live sizes change every iteration: specialised on them (a size of 1, a multiple of 16) the kernel would compile
# again mid-run for each new class of batch.
@triton.jit(do_not_specialize=["live_tokens", "live_reqs", "hidden_live_numel", "gathered_value"])
def _prepare_fill_kernel(
    input_ids, positions, out_cache_loc, seq_lens, req_pool_indices, num_correct_drafts, num_accept_tokens, hidden_bits,
    gathered, gathered_logprob,
    src_input_ids, src_positions, src_seq_lens, src_req_pool_indices, src_accept_lens, src_hidden_bits,
    live_tokens, token_rows, live_reqs, max_reqs, hidden_live_numel, gathered_len, gathered_value,
    padding_slot, seq_len_fill, padding_row, token_programs,
    TOKEN_BLOCK: tl.constexpr, REQ_BLOCK: tl.constexpr, HIDDEN_BLOCK: tl.constexpr, GATHERED_BLOCK: tl.constexpr,
    HAS_GATHERED: tl.constexpr,
):
    # Programs [0, token_programs) own blocks of token rows, program token_programs owns every request lane and the
    # gathered counts, the rest own blocks of the live hidden rows: each buffer element has exactly one writer.
    pid = tl.program_id(0)
    # Triton types a name across the branches of an if: each branch keeps names of its own (the blocks differ in shape).
    if pid < token_programs:
        row = pid * TOKEN_BLOCK + tl.arange(0, TOKEN_BLOCK)
        row_in_buffer = row < token_rows
        row_live = row < live_tokens
        ids = tl.load(src_input_ids + row, mask=row_live, other=0).to(tl.int64)
        tl.store(input_ids + row, ids, mask=row_in_buffer)
        pos = tl.load(src_positions + row, mask=row_live, other=0).to(tl.int64)
        tl.store(positions + row, pos, mask=row_in_buffer)
        tl.store(out_cache_loc + row, tl.zeros([TOKEN_BLOCK], dtype=tl.int64) + padding_slot, mask=row_in_buffer)
    elif pid == token_programs:
        lane = tl.arange(0, REQ_BLOCK)
        lane_in_buffer = lane < max_reqs
        lane_live = lane < live_reqs
        seq = tl.load(src_seq_lens + lane, mask=lane_live, other=0).to(tl.int64)
        tl.store(seq_lens + lane, tl.where(lane_live, seq, tl.zeros([REQ_BLOCK], dtype=tl.int64) + seq_len_fill), mask=lane_in_buffer)
        rows = tl.load(src_req_pool_indices + lane, mask=lane_live, other=0).to(tl.int64)
        tl.store(req_pool_indices + lane, tl.where(lane_live, rows, tl.zeros([REQ_BLOCK], dtype=tl.int64) + padding_row),
                 mask=lane_in_buffer)
        accept = tl.load(src_accept_lens + lane, mask=lane_live, other=1).to(tl.int64)
        tl.store(num_correct_drafts + lane, accept - 1, mask=lane_live)  # padded lanes keep their (in-range) stale counts
        tl.store(num_accept_tokens + lane, accept, mask=lane_live)
        if HAS_GATHERED:
            g = tl.arange(0, GATHERED_BLOCK)
            counts = tl.zeros([GATHERED_BLOCK], dtype=tl.int32) + gathered_value
            tl.store(gathered + g, counts, mask=g < gathered_len)
            tl.store(gathered_logprob + g, counts, mask=g < gathered_len)
    else:
        flat = (pid - token_programs - 1).to(tl.int64) * HIDDEN_BLOCK + tl.arange(0, HIDDEN_BLOCK)
        flat_live = flat < hidden_live_numel
        tl.store(hidden_bits + flat, tl.load(src_hidden_bits + flat, mask=flat_live), mask=flat_live)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _source(src: torch.Tensor, dst: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """`src` as the kernel reads it: contiguous, on the buffers' device (a copy only where it is not already)."""
    if tuple(src.shape) != shape:
        raise ValueError(f"fill_prepare_buffers: {name} has shape {tuple(src.shape)}, the batch needs {shape}")
    return src.to(device=dst.device).contiguous()


def fill_prepare_buffers(buffers: DraftExtendInputBuffers, inp: DraftExtendInputs, bs: int, tokens_per_bs: int, pad: LanePadding) -> None:
    """The native reset, live copy-in and gathered fill of the device buffers, in one launch (bucket `bs`).

    Graph-safe only in the sense the native fill is: it runs outside the graphs, before each replay;
    the grid depends on the live batch, so it is never captured.
    """
    raw_bs, T = inp.bs, tokens_per_bs
    max_bs = buffers.seq_lens.shape[0]
    token_rows = buffers.input_ids.shape[0]
    if not 0 <= raw_bs <= bs <= max_bs or token_rows != max_bs * T:
        raise ValueError(f"fill_prepare_buffers: {raw_bs} live lanes in bucket {bs} of buffers for {max_bs} x {T} tokens")
    live_tokens, hidden = raw_bs * T, buffers.hidden_states.shape[1]
    if inp.hidden_states.dtype != buffers.hidden_states.dtype:  # the native copy_ casts; so does this, before the launch
        inp_hidden = inp.hidden_states.to(buffers.hidden_states.dtype)
    else:
        inp_hidden = inp.hidden_states
    if raw_bs:
        sources = (
            _source(inp.input_ids, buffers.input_ids, "input_ids", (live_tokens,)),
            _source(inp.positions, buffers.positions, "positions", (live_tokens,)),
            _source(inp.seq_lens, buffers.seq_lens, "seq_lens", (raw_bs,)),
            _source(inp.req_pool_indices, buffers.req_pool_indices, "req_pool_indices", (raw_bs,)),
            _source(inp.accept_lens, buffers.num_accept_tokens, "accept_lens", (raw_bs,)),
            _as_bits(_source(inp_hidden, buffers.hidden_states, "hidden_states", (live_tokens, hidden))),
        )
    else:  # an idle rank replaying its DP group's bucket: nothing is read, each source pointer is its own buffer's
        sources = (buffers.input_ids, buffers.positions, buffers.seq_lens, buffers.req_pool_indices, buffers.num_accept_tokens,
                   _as_bits(buffers.hidden_states))
    gathered, gathered_logprob = buffers.global_num_tokens_gpu, buffers.global_num_tokens_for_logprob_gpu
    has_gathered = gathered is not None
    gathered_len = gathered.shape[0] if has_gathered else 0
    token_programs = triton.cdiv(token_rows, TOKEN_BLOCK)
    hidden_live_numel = live_tokens * hidden
    grid = (token_programs + 1 + triton.cdiv(hidden_live_numel, HIDDEN_BLOCK),)
    run_kernel(
        _prepare_fill_kernel, grid,
        buffers.input_ids, buffers.positions, buffers.out_cache_loc, buffers.seq_lens, buffers.req_pool_indices,
        buffers.num_correct_drafts, buffers.num_accept_tokens, _as_bits(buffers.hidden_states),
        gathered if has_gathered else buffers.seq_lens, gathered_logprob if has_gathered else buffers.seq_lens,  # unread without
        *sources,
        live_tokens, token_rows, raw_bs, max_bs, hidden_live_numel, gathered_len, bs * T,
        pad.slot, SEQ_LEN_FILL_VALUE, pad.row, token_programs,
        TOKEN_BLOCK=TOKEN_BLOCK, REQ_BLOCK=triton.next_power_of_2(max_bs), HIDDEN_BLOCK=HIDDEN_BLOCK,
        GATHERED_BLOCK=triton.next_power_of_2(max(gathered_len, 1)), HAS_GATHERED=has_gathered,
    )
