"""ModelRunner: SchedulerOutput -> model inputs -> forward -> sample -> ModelRunnerOutput. No policy here.

What to compute is decided by the scheduler; the runner only keeps its copy of each request current, executes
the KV tiers' plans and the copy-on-write plans (disk deletes and stores, host stores, host loads, disk loads, loads
of received blocks, then copy-on-write), runs the model on the flattened batch and samples where a request reached
its last token. A request whose disk or remote load failed is left out of the step and dropped; the output says so
(``kv_load_failures``).
"""

from __future__ import annotations

import torch

from folio.core.sched_output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from folio.kernels.kv_block_copy import BlockCopy, aten_copy_blocks
from folio.model.llama import LlamaForCausalLM
from folio.model.noop import NoopCausalLM
from folio.sample.logprobs import compute_prompt_logprobs
from folio.sample.metadata import SamplingMetadata
from folio.sample.sampler import Sampler
from folio.sample.seeding import position_generator
from folio.spec_decode.ngram_proposer import NgramProposer
from folio.step_timer import FORWARD, PREPARE_INPUTS, SAMPLE, StepTimer
from folio.structured.bitmask import bitmask_for_rows, constrained_greedy
from folio.worker.decode_graphs import DecodeGraphs
from folio.worker.draft_runner import DraftModelRunner
from folio.worker.input_batch import ModelInput, prepare_model_input
from folio.worker.kv_connector import RemoteKVLoader
from folio.worker.kv_disk import DiskKVTransfer
from folio.worker.kv_offload import KVTransfer
from folio.worker.request_state import CachedRequestState, RequestStates
from folio.worker.spec_decode import propose_drafts, verify_drafts


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM | NoopCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.requests = RequestStates()
        self.sampler = Sampler()
        self.step_timer: StepTimer | None = None  # set only by profiling benchmarks (folio.step_timer)
        self.decode_graphs: DecodeGraphs | None = None  # set by enable_decode_graphs
        self.block_copy: BlockCopy = aten_copy_blocks  # copy-on-write; the worker sets the CPU plan's choice
        self.kv_transfer: KVTransfer | None = None  # set by the worker when a host KV tier exists
        self.kv_disk: DiskKVTransfer | None = None  # set by the worker when a disk tier exists under it
        self.kv_remote: RemoteKVLoader | None = None  # set by the worker for a kv_transfer_config consumer
        self.proposer: NgramProposer | None = None  # set by the worker with an n-gram speculative_config
        self.draft_runner: DraftModelRunner | None = None  # set by the worker with a draft-model one
        self.is_last_stage = True  # False on a pipeline stage before the last: it runs its layers, never samples

    def enable_decode_graphs(
        self, max_num_seqs: int, max_model_len: int, scratch_slot: int, capture: bool
    ) -> DecodeGraphs:
        """Runs decode-only steps through DecodeGraphs from now on: captured CUDA graphs, or (capture=False) the
        same padded forward run eagerly. scratch_slot is a KV slot no request owns (padding writes there)."""
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.block_size,
            max_num_seqs,
            max_model_len,
            scratch_slot,
            self.device,
            capture,
        )
        graphs.capture_all()
        self.decode_graphs = graphs
        return graphs

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        failures, failed_hashes = self._run_kv_plans(sched)
        if sched.block_copies:
            self._copy_blocks(sched.block_copies)
        req_ids = [req_id for req_id in sched.num_scheduled_tokens if req_id not in failures]
        if not req_ids:
            return ModelRunnerOutput([], [], [], kv_load_failures=failures, failed_disk_hashes=failed_hashes)
        states = [self.requests[r] for r in req_ids]
        model_input = prepare_model_input(
            states,
            [sched.num_scheduled_tokens[r] for r in req_ids],
            self.block_size,
            self.device,
            sched.scheduled_spec_decode_tokens,
        )
        timer = self.step_timer
        if timer is not None:
            timer.lap(PREPARE_INPUTS)
        # [S + P + sum(k_i + 1), hidden]: the rows that need logits (the model skips the others' last layer)
        if self.decode_graphs is not None and self.decode_graphs.can_run(model_input):
            all_rows = self.decode_graphs.run(model_input)[model_input.logits_indices]
        else:
            all_rows = self.model(
                model_input.input_ids,
                model_input.positions,
                self.kv_caches,
                model_input.attn,
                output_rows=model_input.logits_indices,
            )
        if not self.is_last_stage:  # its output went on to the next stage (folio/parallel/pipeline_parallel.py)
            return ModelRunnerOutput(req_ids, [[] for _ in req_ids], [None] * len(req_ids))
        rows, spec_rows = all_rows, None
        if model_input.spec_req_ids:  # speculative decoding: the drafted requests' rows come last
            num_main_rows = all_rows.shape[0] - sum(len(d) + 1 for d in model_input.spec_draft_token_ids)
            rows, spec_rows = all_rows[:num_main_rows], all_rows[num_main_rows:]
        num_sampled = len(model_input.sample_req_ids)
        states = [self.requests[r] for r in model_input.sample_req_ids]
        metadata = self._sampling_metadata(states) if num_sampled else None
        if metadata is not None and sched.grammar_bitmask is not None:  # structured outputs: the sampler's 1st stage
            metadata.grammar_bitmask = bitmask_for_rows(
                model_input.sample_req_ids, sched.structured_output_request_ids, sched.grammar_bitmask, self.device
            )
        greedy_ids = spec_argmax_ids = None
        if metadata is not None and not model_input.prompt_logprobs and self.sampler.only_argmax(metadata, True):
            # One pass of the LM head for the drafted rows too (it streams the whole LM-head weight each call).
            # With drafts, logits where the model has no fused arg-max (CUDA): still one LM-head pass; without, None
            # there, and the sampler takes the arg-max of the rows' logits below.
            greedy_ids = (
                self._greedy_token_ids(all_rows)
                if spec_rows is not None
                else self.model.compute_greedy_token_ids(all_rows)
            )
            if greedy_ids is not None and spec_rows is not None:
                greedy_ids, spec_argmax_ids = greedy_ids[: rows.shape[0]], greedy_ids[rows.shape[0] :]
            if greedy_ids is not None and metadata.grammar_bitmask is not None:  # logits only where banned
                greedy_ids = constrained_greedy(greedy_ids, metadata.grammar_bitmask, lambda r: self._logits(rows, r))
        no_logits = greedy_ids is not None or rows.shape[0] == 0
        logits = None if no_logits else self.model.compute_logits(rows)  # [S + P, vocab]
        if timer is not None:
            timer.lap(FORWARD)
        sampled: dict[str, tuple[list[int], LogprobsLists | None]] = {}
        if greedy_ids is not None:
            sampled = self._record(states, greedy_ids.tolist(), None)
        elif metadata is not None:
            assert logits is not None
            sampled = self._sample(logits[:num_sampled], metadata, states)
        prompt_logprobs = {} if logits is None else self._prompt_logprobs(logits[num_sampled:], model_input)
        if spec_rows is not None:
            sampled.update(
                verify_drafts(
                    spec_rows,
                    model_input,
                    self.requests,
                    self._greedy_token_ids,
                    self.model.compute_logits,
                    self.sampler,
                    self.vocab_size,
                    sched.structured_output_request_ids,
                    sched.grammar_bitmask,
                    spec_argmax_ids,
                )
            )
        drafts = {}
        if self.proposer is not None:
            drafts = propose_drafts(self.proposer, sampled, self.requests)
        if self.draft_runner is not None:
            drafts = self.draft_runner.propose(sched.num_scheduled_tokens, req_ids, sampled, self.requests)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled.get(r, ([], None))[0] for r in req_ids],
            logprobs=[sampled.get(r, ([], None))[1] for r in req_ids],
            prompt_logprobs=prompt_logprobs,
            kv_load_failures=failures,
            failed_disk_hashes=failed_hashes,
            draft_token_ids=drafts,
        )
        if timer is not None:
            timer.lap(SAMPLE)
        return output

    def _run_kv_plans(self, sched: SchedulerOutput) -> tuple[dict[str, int], list[int]]:
        """The disk tier's deletes and stores, the host tier's stores and loads, the disk loads, the loads of received
        blocks. Returns, for the failed loads, {request id: tokens whose K/V are valid} (those requests are dropped),
        and the failed disk loads' hashes."""
        disk = sched.kv_disk
        if disk and self.kv_disk is None:
            raise RuntimeError("the scheduler planned disk KV copies but this worker has no disk KV tier")
        if self.kv_disk is not None and (disk.deletes or disk.stores):
            self.kv_disk.delete_and_store(disk.deletes, disk.stores)
        if sched.kv_stores or sched.kv_loads:  # the host tier's plans: every store, then every load
            if self.kv_transfer is None:
                raise RuntimeError("the scheduler planned host KV copies but this worker has no host KV tier")
            self.kv_transfer.execute(sched.kv_stores, sched.kv_loads)
        failed = self.kv_disk.load(disk.loads) if self.kv_disk is not None and disk.loads else []
        failed_remote = []
        if sched.kv_remote_loads:
            if self.kv_remote is None:
                raise RuntimeError(
                    "the scheduler planned loads of received KV blocks but this worker is not a consumer"
                )
            failed_remote = self.kv_remote.load(sched.kv_remote_loads)
        if not failed and not failed_remote:
            return {}, []
        failed_blocks = {block_id for _, block_id in failed + failed_remote}
        failures = {}
        for req_id in sched.num_scheduled_tokens:
            block_ids = self.requests[req_id].block_ids
            index = next((i for i, block_id in enumerate(block_ids) if block_id in failed_blocks), None)
            if index is not None:
                failures[req_id] = index * self.block_size
        self.requests.remove(set(failures))
        return failures, [block_hash for block_hash, _ in failed]

    def _greedy_token_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R] arg-max token ids, by the same path a greedy step without drafts takes."""
        token_ids = self.model.compute_greedy_token_ids(rows)
        return token_ids if token_ids is not None else self.model.compute_logits(rows).argmax(dim=-1)

    def _logits(self, rows: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(rows.index_select(0, indices))

    def _update_states(self, sched: SchedulerOutput) -> None:
        self.requests.remove(sched.finished_req_ids | sched.preempted_req_ids)
        self.requests.add_new(sched.scheduled_new_reqs)
        self.requests.apply_diffs(sched.scheduled_cached_reqs)
        if self.draft_runner is not None:
            self.draft_runner.update_states(sched)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: K and V of each src block into its dst block, in every layer, before anyone writes."""
        self.block_copy(self.kv_caches, [c[0] for c in copies], self.kv_caches, [c[1] for c in copies])
        if self.draft_runner is not None:
            self.draft_runner.copy_blocks(copies, self.block_copy)

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        return SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            generators=[self._generator(s) for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
        )

    def _sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, states: list[CachedRequestState]
    ) -> dict[str, tuple[list[int], LogprobsLists | None]]:
        """Samples one token per sampling request (logits row i is states[i]'s)."""
        out = self.sampler.forward(logits, metadata)
        row_logprobs: list[LogprobsLists | None] = [None] * len(states)
        if out.logprobs is not None:
            row_logprobs = out.logprobs.split_rows([s.sampling_params.logprobs for s in states])
        return self._record(states, out.sampled_token_ids.tolist(), row_logprobs)

    @staticmethod
    def _record(
        states: list[CachedRequestState], token_ids: list[int], row_logprobs: list[LogprobsLists | None] | None
    ) -> dict[str, tuple[list[int], LogprobsLists | None]]:
        """Appends each request's sampled token to the runner's copy of it; the runner output's per-request part."""
        result: dict[str, tuple[list[int], LogprobsLists | None]] = {}
        for row, state in enumerate(states):
            state.output_token_ids.append(token_ids[row])
            result[state.req_id] = ([token_ids[row]], None if row_logprobs is None else row_logprobs[row])
        return result

    def _generator(self, state: CachedRequestState) -> torch.Generator | None:
        return position_generator(state.sampling_params, len(state.output_token_ids), self.device)

    def _prompt_logprobs(self, logits: torch.Tensor, model_input: ModelInput) -> dict[str, LogprobsLists]:
        result: dict[str, LogprobsLists] = {}
        for piece in model_input.prompt_logprobs:
            count = len(piece.target_token_ids)
            k = self.requests[piece.req_id].sampling_params.prompt_logprobs or 0
            targets = torch.tensor(piece.target_token_ids, dtype=torch.long, device=self.device)
            result[piece.req_id] = compute_prompt_logprobs(
                logits[piece.start : piece.start + count], targets, k
            ).tolists()
        return result
