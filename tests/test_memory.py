"""Memory as engines address it: paged LIFO allocators, in-graph slot lookup, the page table,
the rotary table, and the seeded norm weights that make hand-offs before/after a norm visible."""
import math

import pytest
import torch

from harness.cases.case import CaseError, load_case
from runners.attention.torch_ref import TorchAttnBackend
from runners.batch import ForwardBatch, ForwardMode
from runners.config import DEFAULT_MODEL, ModelConfig, SpecConfig
from runners.memory import (
    PADDING_SLOT,
    PageAllocator,
    ReqToTokenPool,
    TokenToKVPool,
    assign_out_cache_loc,
    check_page_size,
    page_slots,
)
from runners.model import DraftLayer, apply_rope, rms_norm, rope_cos_sin_cache
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout
from runners.scheduler import KVBook, Request
from runners.spec_decode import loop_unsupported_reason

CPU = torch.device("cpu")


def test_page_allocator_hands_out_the_most_recently_freed_page_first_and_never_page_0():
    a = PageAllocator(num_slots=32, page_size=4)  # pages 1..7
    first = a.alloc(3)
    assert first == [1, 2, 3]
    a.release([2, 3])
    assert a.alloc(1) == [2]  # the first page of the last release
    assert 0 not in a.alloc(len(a.free)) and not a.free
    with pytest.raises(RuntimeError, match="exhausted"):
        a.alloc(1)


@pytest.mark.parametrize("bad", [0, 3, 6, -4, 2.0, True])
def test_page_size_must_be_a_power_of_two(bad):
    with pytest.raises(ValueError, match="power of two"):
        check_page_size(bad)


def test_page_slots_lay_positions_out_by_page():
    assert page_slots([5, 2], 6, 4) == [20, 21, 22, 23, 8, 9]


def test_request_row_0_is_the_padding_row_and_rows_are_reused_lifo():
    pool = ReqToTokenPool(4, 8, CPU)
    assert pool.req_to_token[0].tolist() == [PADDING_SLOT] * 8
    a, b = pool.alloc(), pool.alloc()
    assert (a, b) == (1, 2)
    pool.release(a)
    assert pool.alloc() == a  # a padded lane holding the stale row `a` now points at the new owner's slots


def test_kv_book_pages_whole_pages_and_frees_only_pages_past_the_last_kept_position():
    book = KVBook(ReqToTokenPool(4, 16, CPU), num_slots=32, page_size=4)
    a, b = Request(0, (1, 2), 4), Request(1, (3,), 4)
    for r in (a, b):
        book.admit(r)
    book.ensure(a, 6)  # pages 1, 2
    book.ensure(b, 3)  # page 3
    assert a.slots == [4, 5, 6, 7, 8, 9] and b.slots == [12, 13, 14]
    assert book.req_pool.req_to_token[a.req_pool_idx, :6].tolist() == a.slots
    assert not book.problems([a, b])
    book.truncate(a, 5)  # position 4 still lives in page 2: nothing freed
    assert book.allocator.free[-1] != 2 and not book.problems([a, b])
    book.truncate(a, 4)  # page 2 now holds nothing a needs
    assert book.allocator.free[-1] == 2
    book.ensure(b, 6)  # b's next page is the one a just freed
    assert b.slots[4:] == [8, 9] and not book.problems([a, b])


def test_kv_book_problems_see_a_page_freed_while_still_referenced():
    book = KVBook(ReqToTokenPool(4, 16, CPU), num_slots=32, page_size=4)
    a = Request(0, (1,), 4)
    book.admit(a)
    book.ensure(a, 6)
    book.allocator.release([2])  # page 2 still holds positions 4, 5 of a
    assert any("owned and free at once" in p for p in book.problems([a]))


def _batch(req_pool_indices, positions, seq_lens, tokens_per_lane):
    i64 = dict(dtype=torch.int64)
    bs = len(req_pool_indices)
    n = bs * tokens_per_lane
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=torch.zeros(n, **i64), positions=torch.tensor(positions, **i64),
        seq_lens=torch.tensor(seq_lens, **i64), req_pool_indices=torch.tensor(req_pool_indices, **i64),
        out_cache_loc=torch.full((n,), -1, **i64), extend_seq_lens=torch.full((bs,), tokens_per_lane, **i64),
        extend_start_loc=torch.arange(bs) * tokens_per_lane, spec_info=None,
    )


def test_in_graph_slot_lookup_sends_the_canonical_padded_lane_to_the_padding_slot_and_a_stale_row_to_live_memory():
    pool = ReqToTokenPool(4, 8, CPU)
    live = pool.alloc()
    pool.req_to_token[live, :4] = torch.tensor([9, 10, 11, 12])
    fb = _batch([live, 0, live], [2, 3, 0, 0, 0, 0], [4, 1, 1], 2)  # lane 1 canonical; lane 2 a stale row at position 0
    lane = torch.tensor([0, 0, 1, 1, 2, 2])
    assign_out_cache_loc(pool.req_to_token, fb.req_pool_indices, fb.positions, lane, fb.out_cache_loc)
    assert fb.out_cache_loc.tolist() == [11, 12, PADDING_SLOT, PADDING_SLOT, 9, 9]


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_page_table_reads_the_slots_req_to_token_holds(page_size):
    """The torch backend reads keys through a page table (req_to_token[row, ::page_size] // page_size);
    for rows laid out by page that is, position by position, the row itself."""
    pool = ReqToTokenPool(4, 12, CPU)
    kv = TokenToKVPool(1, 64, 1, 2, torch.float32, CPU, page_size)
    rows = []
    for n in (10, 7):
        idx = pool.alloc()
        pool.req_to_token[idx, :n] = torch.tensor(kv.alloc(n))
        rows.append(idx)
    fb = _batch(rows, [9, 9, 6, 6], [10, 7], 2)
    meta = TorchAttnBackend(pool, kv).init_forward_metadata(fb)
    want = pool.req_to_token[torch.tensor(rows)][torch.tensor([0, 0, 1, 1])]
    mask = meta.key_mask
    assert torch.equal(meta.kv_slots[mask], want[mask])


def test_rotary_table_gather_matches_the_closed_form():
    cfg = ModelConfig()
    cache = rope_cos_sin_cache(cfg)
    assert cache.shape == (cfg.max_context_len, cfg.head_dim)
    d, pos = cfg.head_dim, 37
    x = torch.randn(1, 1, d, generator=torch.Generator().manual_seed(0))
    got = apply_rope(x, torch.tensor([pos]), cache)
    ang = [pos * cfg.rope_theta ** (-2 * i / d) for i in range(d // 2)]
    x1, x2 = x[0, 0, : d // 2].tolist(), x[0, 0, d // 2 :].tolist()
    want = ([a * math.cos(t) - b * math.sin(t) for a, b, t in zip(x1, x2, ang, strict=True)]
            + [b * math.cos(t) + a * math.sin(t) for a, b, t in zip(x1, x2, ang, strict=True)])
    torch.testing.assert_close(got[0, 0], torch.tensor(want), rtol=0, atol=1e-5)  # float32 cos/sin of angles up to 37 rad


def test_a_position_past_the_rotary_table_is_not_clamped():
    """The replay fill keeps padded positions at 0; a position past the table is a fill bug and must not pass silently."""
    cache = rope_cos_sin_cache(DEFAULT_MODEL)
    with pytest.raises(IndexError):
        apply_rope(torch.zeros(1, 1, DEFAULT_MODEL.head_dim), torch.tensor([DEFAULT_MODEL.max_context_len]), cache)


def test_norm_weights_are_seeded_and_not_unit_so_a_hand_off_after_a_norm_shows():
    ctx = RankContext(ParallelLayout(), 0, comm=None)
    a, b = DraftLayer(DEFAULT_MODEL, 0, ctx), DraftLayer(DEFAULT_MODEL, 0, ctx)
    assert torch.equal(a.final_norm, b.final_norm) and not torch.equal(a.final_norm, a.hnorm)
    assert (a.final_norm - 1).abs().max() > 0.05
    x = torch.randn(5, DEFAULT_MODEL.hidden_size, generator=torch.Generator().manual_seed(1)) * 3
    eps = DEFAULT_MODEL.rms_eps
    ones = torch.ones_like(a.final_norm)
    # RMS normalisation is scale-free: with unit weights the draft's hnorm undoes a final norm ...
    torch.testing.assert_close(rms_norm(rms_norm(x, ones, eps), a.hnorm, eps), rms_norm(x, a.hnorm, eps), rtol=1e-5, atol=1e-5)
    # ... with per-channel weights it does not
    assert (rms_norm(rms_norm(x, a.final_norm, eps), a.hnorm, eps) - rms_norm(x, a.hnorm, eps)).abs().max() > 0.01


def test_case_page_size_is_checked_with_the_field_named(tmp_path):
    case = load_case("tp2_page4_shrink")
    with open(case.path) as f:
        text = f.read().replace("page_size = 4", "page_size = 3")
    bad = tmp_path / "tp2_page4_shrink.toml"
    bad.write_text(text)
    with pytest.raises(CaseError, match="spec.page_size"):
        load_case(str(bad))
    assert load_case("tp2_page4_shrink").scenario.spec.page_size == 4


def test_the_loop_runs_tree_verification_on_pages():  # tree nodes sit in the request's own slots; accepted KV is moved
    assert loop_unsupported_reason(SpecConfig(num_steps=2, topk=2, page_size=4)) is None
    assert loop_unsupported_reason(SpecConfig(num_steps=2, topk=1, page_size=4)) is None
