"""The model runner's side of the proposer: NPUModelRunner's state and the steps it takes around the draft.

The proposer reads the runner's persistent buffers (query_start_loc, seq_lens, the block
table, the slot mapping), its dispatcher and three of its methods (compiled from the release:
loader.py). What the runner does to them is reproduced here from model_runner_v1.py, each
step citing its lines: settling the graph mode and capture sizes before capture, the capture
loop's _dummy_run before each drafter dummy_run, and a decode step's _prepare_inputs /
_build_attention_metadata before prepare_inputs_padded and _propose. The live batch is the
adapter's choice (ids, positions, acceptances: module constants), laid out so that a KV slot
names its request and position and a token id names its request and step.
"""
from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from harness.engines.vllm_ascend.config import AscendCheckConfig, World
from harness.engines.vllm_ascend.loader import RUNNER_METHODS, AscendEngine
from harness.engines.vllm_ascend.npu import RankTables
from harness.engines.vllm_ascend.standins import KV_BLOCK_SIZE, Strict, cpu_gpu_buffer, kv_cache_spec

FIRST_BLOCK = 100  # block table row i holds blocks FIRST_BLOCK + i * width ..: a slot names its request and position
TOKEN_BASE = 1000  # the verified tokens' ids (request i, token j: TOKEN_BASE + 16 * i + j)
NEXT_BASE = 2000  # the target's sampled next token of request i at iteration t: NEXT_BASE + 64 * i + t
SEQ_BASE = 40  # request i's computed tokens before iteration t: SEQ_BASE + 9 * i + 5 * t


def blocks_per_request(cfg: AscendCheckConfig) -> int:
    return -(-cfg.max_model_len // KV_BLOCK_SIZE)


def slot_of(cfg: AscendCheckConfig, req: int, position: int) -> int:
    """The KV slot of request `req`'s token at `position` (its block-table row's block, the offset in it)."""
    return (FIRST_BLOCK + req * blocks_per_request(cfg) + position // KV_BLOCK_SIZE) * KV_BLOCK_SIZE + position % KV_BLOCK_SIZE


@dataclass
class DecodeBatch:
    """What the runner hands the proposer for one decode step with 1 + K tokens per request."""

    target_desc: Any  # the target's batch descriptor (the proposer reads .uniform)
    common_attn_metadata: Any  # the spec-decode metadata, unpadded (_build_attention_metadata's)
    spec_decode_metadata: Strict
    valid_sampled_tokens_count: torch.Tensor  # accepted drafts + 1, per request
    next_token_ids: torch.Tensor
    seq_lens: list[int]  # per request, after its verified tokens


class ModelRunner:
    """NPUModelRunner as the proposer sees it: a strict stand-in over the state it reads, and the runner's steps."""

    def __init__(self, engine: AscendEngine, cfg: AscendCheckConfig, world: World, rank: int, vcfg: Strict) -> None:
        self.engine, self.cfg, self.world, self.rank, self.vcfg = engine, cfg, world, rank, vcfg
        self.q = 1 + cfg.num_speculative_tokens
        self.cg = engine.modules["compilation"].CUDAGraphMode
        n, max_tokens, width = cfg.max_num_seqs, cfg.max_num_seqs * self.q, blocks_per_request(cfg)
        self.block_table = torch.zeros(n, width, dtype=torch.int32)
        for i in range(n):
            self.block_table[i] = self._row(i)
        table = Strict("block_table", get_device_tensor=lambda num_reqs=None: self.block_table,
                       slot_mapping=cpu_gpu_buffer(engine, max_tokens, torch.int32), commit_block_table=lambda num_reqs: None)
        att = engine.modules["attention"]
        self.state = Strict(
            "model_runner", vllm_config=vcfg, compilation_config=vcfg.compilation_config, model_config=vcfg.model_config,
            speculative_config=vcfg.speculative_config, max_num_reqs=n, max_num_tokens=max_tokens, pin_memory=False,
            pcp_size=1, dcp_size=1, pcp_rank=0, dcp_rank=0, enable_enpu=False, use_eagle=True, uniform_decode_query_len=self.q, dp_size=world.dp,
            dp_rank=rank, ascend_config=None, arange_np=np.arange(max_tokens + 1, dtype=np.int32),
            query_start_loc=cpu_gpu_buffer(engine, n + 2, torch.int32),  # + 2: room for _pad_query_start_loc_for_fia's dummy request
            seq_lens=torch.zeros(n, dtype=torch.int32), optimistic_seq_lens_cpu=torch.zeros(n, dtype=torch.int32),
            positions=torch.zeros(max_tokens, dtype=torch.int64), input_ids=cpu_gpu_buffer(engine, max_tokens, torch.int32),
            actual_seq_lengths_q=[], decode_token_per_req=self.q, attn_state=att.AscendAttentionState.ChunkedPrefill,
            cudagraph_dispatcher=engine.attr("dispatcher", "CudagraphDispatcher")(vcfg), dynamic_eplb=False,
            eplb_heat_collection_status=False, _dsa_positions_cpu_buf=None,
            attn_groups=[[None]],  # the target's groups: dummy_run only asks that there are some
            input_batch=Strict("input_batch", lora_id_to_lora_request={}, block_table=[table],
                               num_computed_tokens_cpu_tensor=torch.zeros(n, dtype=torch.int32)),
            _make_buffer=lambda *size, dtype, numpy=True: cpu_gpu_buffer(engine, size[0], dtype),
            # from 0.24: per-token group buffers of the KV-compression path (unused by a plain draft: zeros)
            group_len=cpu_gpu_buffer(engine, max_tokens, torch.int32), group_key_idx=cpu_gpu_buffer(engine, max_tokens, torch.int32),
            group_key_cache_idx=cpu_gpu_buffer(engine, max_tokens, torch.int32),
            # from 0.25 (vLLM's GPUModelRunner.synchronize_input_prep): waits on prepare_inputs_event, None without async
            # scheduling, when it only yields
            synchronize_input_prep=contextlib.nullcontext,
        )
        for name, fn in engine.runner_methods.items():
            if name in RUNNER_METHODS:  # (the module function among them is found by the methods as a global)
                object.__setattr__(self.state, name, types.MethodType(fn, self.state))

    def _row(self, req: int) -> torch.Tensor:
        width = blocks_per_request(self.cfg)
        return FIRST_BLOCK + req * width + torch.arange(width, dtype=torch.int32)

    def pad_for_fia(self, num_tokens_padded: int, num_reqs_padded: int, num_reqs: int, mode: Any, batch_desc_num_reqs: Any) -> int:
        """The runner's _pad_query_start_loc_for_fia on its query_start_loc (a parameter from 0.23, the runner's own before)."""
        fn = self.state._pad_query_start_loc_for_fia
        args = dict(num_tokens_padded=num_tokens_padded, num_reqs_padded=num_reqs_padded, num_reqs=num_reqs,
                    cudagraph_runtime_mode=mode, batch_desc_num_reqs=batch_desc_num_reqs)
        if "query_start_loc" in inspect.signature(fn).parameters:
            args["query_start_loc"] = self.state.query_start_loc
        return fn(**args)

    def settle_cudagraph_mode(self, proposer: Any) -> None:
        """_check_and_update_cudagraph_mode (model_runner_v1.py:5045-5099): the mode and capture sizes settled by vLLM's rule
        for the draft backend's graph support, the runner's dispatch keys, the drafter's, and the ACL graph parameter
        tables (per captured token count, the attention tasks captured at it)."""
        eng, vcfg = self.engine, self.vcfg
        builder = eng.modules["attention"].AscendAttentionBackend.get_builder_cls()
        support = builder.get_cudagraph_support(vcfg, kv_cache_spec(eng))
        resolve = vcfg.compilation_config.resolve_cudagraph_mode_and_sizes
        args = dict(min_cg_support=support, min_cg_attn_backend=builder.__name__, uniform_decode_query_len=self.q,
                    tensor_parallel_size=1, kv_cache_config=None, max_num_reqs=self.cfg.max_num_seqs)
        if "use_v2_model_runner" in inspect.signature(resolve).parameters:  # from vLLM 0.25 (the runner passes False)
            args["use_v2_model_runner"] = False
        mode = resolve(**args)
        self.state.cudagraph_dispatcher.initialize_cudagraph_keys(mode, self.q)
        proposer.initialize_cudagraph_keys(mode)
        sizes = sorted({d.num_tokens for _, descs in self.state.cudagraph_dispatcher.get_capture_descs() for d in descs})
        acl = eng.modules["acl_graph"]
        for name, setter in (("_graph_params", acl.set_graph_params), ("_draft_graph_params", acl.set_draft_graph_params)):
            tables = getattr(acl, name)
            if not isinstance(tables, RankTables):
                tables = RankTables(eng.runtime)
            setattr(acl, name, None)  # the release's setter refuses a table already set
            setter(sizes)
            tables.tables[self.rank] = getattr(acl, name)
            setattr(acl, name, tables)

    def dummy_run(self, proposer: Any, desc: Any, mode: Any) -> None:
        """_dummy_run's part before the drafter (model_runner_v1.py:3399-3538) for a capture key, then the drafter's
        dummy_run as it calls it (3643-3654). `mode` NONE: the warm-up pass; FULL: the capture pass."""
        r, q, num_tokens = self.state, self.q, desc.num_tokens
        if desc.uniform:  # 3407-3411
            num_reqs = min(self.cfg.max_num_seqs, -(-num_tokens // q))
            sched = [q] * num_reqs
            if num_tokens % q:
                sched[-1] = num_tokens % q
            max_query_len = q
        else:  # 3415-3419
            num_reqs = min(num_tokens, self.cfg.max_num_seqs)
            sched = [num_tokens // num_reqs] * num_reqs
            sched[-1] += num_tokens % num_reqs
            max_query_len = num_tokens
        # the warm-up runs eager (its descriptor: the token count alone), the capture pass under the key
        batch_desc = desc if mode == self.cg.FULL else self.engine.modules["vllm_forward_context"].BatchDescriptor(num_tokens)
        num_reqs_padded = batch_desc.num_reqs if batch_desc.num_reqs is not None else num_reqs  # 3467
        # both passes build metadata (_should_build_dummy_attn_metadata: force_attention in the warm-up, FULL in the capture)
        r.optimistic_seq_lens_cpu[:num_reqs] = max_query_len  # 3500-3508 (paged attention is off with a draft)
        r.optimistic_seq_lens_cpu[num_reqs:] = 0
        r.seq_lens.copy_(r.optimistic_seq_lens_cpu)
        r.query_start_loc.np[0] = 0
        r.query_start_loc.np[1: num_reqs + 1] = np.cumsum(sched)
        r.query_start_loc.copy_to_gpu()
        num_reqs_padded = self.pad_for_fia(num_tokens, num_reqs_padded, num_reqs, mode, batch_desc.num_reqs)  # 3519-3526
        if mode != self.cg.FULL:  # 3535-3538: a warm-up invalidates the slots; a capture keeps them
            r.input_batch.block_table[0].slot_mapping.gpu.fill_(-1)
        proposer.dummy_run(num_tokens=num_tokens, with_prefill=False, num_reqs=num_reqs_padded, num_tokens_across_dp=None,
                           aclgraph_runtime_mode=mode, batch_descriptor=batch_desc, in_graph_capturing=mode == self.cg.FULL,
                           is_profile=False)

    def decode_batch(self, t: int, raw: int) -> DecodeBatch:
        """Iteration t's decode step of `raw` requests: each verified 1 + K tokens, request i accepting (i + t) mod (1 + K)
        drafts; the runner's buffers and metadata for it (_prepare_inputs, _build_attention_metadata)."""
        r, q, K = self.state, self.q, self.cfg.num_speculative_tokens
        n = raw * q
        seq_before = [SEQ_BASE + 9 * i + 5 * t for i in range(raw)]
        valid = [1 + (i + t) % q for i in range(raw)]
        target_mode, target_desc = r.cudagraph_dispatcher.dispatch(num_tokens=n, uniform_decode=True)
        num_tokens_padded = target_desc.num_tokens
        num_reqs_padded = target_desc.num_reqs if target_desc.num_reqs is not None else raw
        qsl = r.query_start_loc
        qsl.np[0] = 0
        qsl.np[1: raw + 1] = np.arange(1, raw + 1) * q
        qsl.copy_to_gpu()
        if target_mode == self.cg.FULL:  # 2212-2227
            num_reqs_padded = self.pad_for_fia(num_tokens_padded, num_reqs_padded, raw, target_mode, target_desc.num_reqs)
        seq_after = torch.tensor([s + q for s in seq_before], dtype=torch.int32)
        r.seq_lens[:raw] = seq_after  # 1261-1264
        r.seq_lens[raw:] = 0
        r.optimistic_seq_lens_cpu[:raw] = seq_after  # 1088-1090
        r.optimistic_seq_lens_cpu[raw:] = 0
        positions = [s + j for s in seq_before for j in range(q)]
        r.positions[:n] = torch.tensor(positions)
        r.input_ids.gpu[:n] = torch.tensor([TOKEN_BASE + 16 * i + j for i in range(raw) for j in range(q)], dtype=torch.int32)
        for i in range(raw):  # commit_block_table: this step's requests' rows
            self.block_table[i] = self._row(i)
        self.block_table[raw:num_reqs_padded] = 0  # 3126
        slots = r.input_batch.block_table[0].slot_mapping.gpu
        slots[:n] = torch.tensor([slot_of(self.cfg, i, p) for i in range(raw) for p in positions[i * q:(i + 1) * q]], dtype=torch.int32)
        slots[n:num_tokens_padded] = -1  # 3125
        cm_base = self.engine.attr("attention_utils", "AscendCommonAttentionMetadata")(  # 3161-3191
            query_start_loc=qsl.gpu[: num_reqs_padded + 1], query_start_loc_cpu=qsl.cpu[: num_reqs_padded + 1],
            seq_lens=r.seq_lens[:num_reqs_padded], _seq_lens_cpu=r.optimistic_seq_lens_cpu[:num_reqs_padded],
            seq_lens_cpu_upper_bound=r.optimistic_seq_lens_cpu[:num_reqs_padded], seq_lens_cpu=r.optimistic_seq_lens_cpu[:num_reqs_padded],
            num_computed_tokens_cpu=torch.tensor(seq_before + [0] * (num_reqs_padded - raw), dtype=torch.int32),
            num_reqs=num_reqs_padded, num_actual_tokens=n, max_query_len=q, max_seq_len=int(seq_after.max()),
            block_table_tensor=self.block_table[:num_reqs_padded], slot_mapping=slots[:num_tokens_padded], causal=True,
            is_prefilling=torch.zeros(num_reqs_padded, dtype=torch.bool), num_input_tokens=num_tokens_padded,
            actual_seq_lengths_q=r.actual_seq_lengths_q, positions=r.positions, attn_state=r.attn_state,
            decode_token_per_req=r.decode_token_per_req)  # positions_cpu (compressed models) and the PCP metadata: their None defaults
        cm = cm_base.unpadded(n, raw) if (raw != num_reqs_padded or n != num_tokens_padded) else cm_base  # 3343-3349
        return DecodeBatch(target_desc, cm,
                           Strict("spec_decode_metadata", cu_num_draft_tokens=torch.arange(1, raw + 1, dtype=torch.int32) * K),
                           torch.tensor(valid, dtype=torch.int32),
                           torch.tensor([NEXT_BASE + 64 * i + t for i in range(raw)], dtype=torch.int32), seq_after.tolist())
