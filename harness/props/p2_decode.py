"""P2 over the single-layer draft decode's graph runner inside the loop, on any layout: the replay fill
leaves canonical padded lanes, and poisoning them and every stale region changes no real tree and no live KV.

The draft decode looks its KV write slots up inside the graph from req_to_token[req_pool_indices,
seq_lens + ...], gathers the rotary table by position and the embedding by token id: a padded lane's
request row, seq_len and position decide where it writes and what it reads. harness.decode_props
poisons one TP1 replay built by hand; this instruments every replay of a running loop, so the
gathered branches (attn-TP, MLP-TP gather, DP groups padded to one bucket) are covered too.
"""
from __future__ import annotations

from typing import Callable

from harness.props.outputs import first_bad_row
from harness.props.poison import NAN, RunnerPoison
from harness.verdict import Verdict
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.eagle_draft import DraftDecodeInputs, DraftDecodeOutputs
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.memory import PADDING_ROW
from runners.spec_decode import SpecEngine

_BUFFERS = ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "topk_p", "topk_index", "hidden_states")


class DecodePoison(RunnerPoison):
    """Instruments one engine's draft-decode runner (P2, harness.props.poison): when the clean replay's
    graph starts, the padded lanes must hold the canonical fill (the padding row, the seq-len fill
    value, position 0, token 0); with them and every stale region poisoned, the real requests' trees
    and the live draft KV must be bit-identical.

    Padded lanes' poison: a live request's row and a seq_len inside its prefix (a write through them
    lands in live KV), positions at the end of the rotary table less the steps the graph advances
    them, token id vocab_size - 1, NaN top-k probabilities and hidden states.
    """

    runner = "draft_decode"
    buffers = _BUFFERS

    def __init__(self, engine: SpecEngine, verdict: Verdict):
        g = engine.draft.decode_graph
        if g is None:
            raise ValueError("DecodePoison needs the single-layer draft's graph runner (runner='graph', draft='single_layer')")
        fill = g._fill_for_replay
        g._fill_for_replay = lambda inp: self._checked_fill(g, fill, inp)
        super().__init__(engine, verdict, g)

    def kv_pool(self, g: EAGLEDraftCudaGraphRunner):
        return g.worker.kv_pool

    def _checked_fill(self, g: EAGLEDraftCudaGraphRunner, fill: Callable, inp: DraftDecodeInputs) -> int:
        """The replay fill, then (clean run) the padded lanes as the graph will read them: it advances the positions in place."""
        bs = fill(inp)
        if self.clean:
            self._check_canonical(g, inp.bs, bs)
        return bs

    def _check_canonical(self, g: EAGLEDraftCudaGraphRunner, raw_bs: int, bs: int) -> None:
        k, w = g.T, self.where(raw_bs, bs)
        if bs == raw_bs:
            return  # no padded lane
        for name, per_lane, want in (("positions", True, 0), ("topk_index", False, 0), ("seq_lens", False, SEQ_LEN_FILL_VALUE),
                                     ("req_pool_indices", False, g.worker.pad.row)):
            start = raw_bs * k if per_lane else raw_bs
            tail = getattr(g, name)[start : bs * k if per_lane else bs]
            self.v.checked += 1
            bad = (tail != want).reshape(tail.shape[0], -1).any(dim=1).nonzero()
            if bad.numel():
                at = start + int(bad[0, 0])
                self.v.fail("canonical", name, {**w, "lane" if per_lane else "request": at}, want, getattr(g, name)[at].tolist(),
                            f"padded {'lane' if per_lane else 'request'} {at} after the draft-decode replay fill")

    def poison(self, g: EAGLEDraftCudaGraphRunner, raw_bs: int) -> None:
        k, cfg = g.T, g.worker.cfg
        self.poison_stale(g)
        _, live_rows, _ = self.live()
        g.req_pool_indices[raw_bs:] = live_rows[0] if live_rows else PADDING_ROW
        g.seq_lens[raw_bs:] = 1  # with a live row: the draft slots from its position 1 on are live KV
        g.positions[raw_bs * k :] = cfg.max_context_len - g.steps - 1
        g.topk_index[raw_bs:] = cfg.vocab_size - 1
        g.topk_p[raw_bs:] = NAN
        g.hidden_states[raw_bs:] = NAN

    def compare(self, g: EAGLEDraftCudaGraphRunner, raw_bs: int, bs: int, clean: DraftDecodeOutputs, poisoned: DraftDecodeOutputs,
                s1: dict) -> None:
        w = self.where(raw_bs, bs)
        for name, t_c in clean.tensors().items():
            t_p = getattr(poisoned, name)
            self.v.checked += 1
            bad = first_bad_row(t_c.reshape(1, -1) if t_c.dim() == 0 else t_c, t_p.reshape(1, -1) if t_p.dim() == 0 else t_p, None)
            if bad is not None:
                self.v.fail("poison", name, {**w, "row": bad[0]}, "bit-identical to the clean replay", f"max |diff| {bad[1]:.3g}",
                            "a real request's draft tree changed when the padded lanes and stale regions were poisoned")
        self.compare_live_kv(g, w, s1, "draft KV")


def install_decode_poison(poisons: list[DecodePoison]) -> Callable[[SpecEngine], None]:
    """A SpecSession hook: one DecodePoison per rank whose draft has a draft-decode graph (each with its own verdict)."""

    def hook(engine: SpecEngine) -> None:
        if getattr(engine.draft, "decode_graph", None) is not None:
            poisons.append(DecodePoison(engine, Verdict("P2")))

    return hook
