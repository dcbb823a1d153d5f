"""FLASH_ATTN's metadata builder: chooses a kernel per phase once, then per step turns the model
runner's `CommonAttentionMetadata` into `FlashAttnMetadata`.

FlashAttention reads the runner's arrays as they are: ``query_start_loc`` is ``cu_seqlens_q``,
``seq_lens`` is ``seqused_k``, the int32 ``block_table`` is ``page_table``. Per step the builder
only decides which kernel serves which rows, from host values (no device sync), and adds what
a kernel needs beyond those arrays: ``seqused_q`` when the prefill kernel leaves the decode rows
of a mixed step to the decode kernel, ``cu_seqlens_k`` for FA2, split counts for TRITON.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch

from pagellm.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm_flash_attn.kernels import AttentionKernel, gpu_capability
from pagellm_flash_attn.kernels.base import sm_name
from pagellm_flash_attn.metadata import FlashAttnMetadata
from pagellm_flash_attn.phases import PhaseChoice, choose_phases

logger = logging.getLogger(__name__)


def _describe(kernel: type[AttentionKernel], capability: tuple[int, int]) -> str:
    split = ", split-KV" if kernel.splits_kv(capability) else ""
    return f"{kernel.name} ({kernel.library} {kernel.version()}{split})"


def startup_line(choice: PhaseChoice, capability: tuple[int, int], block_size: int) -> str:
    """The INFO line that says which kernel serves which phase, and why."""
    prefill, decode = choice.prefill, choice.decode
    line = (
        f"FLASH_ATTN on {sm_name(capability)}, block size {block_size}: prefill and mixed steps "
        f"by {_describe(prefill, capability)} [{choice.prefill_why}]; decode steps by "
    )
    if decode is prefill:
        line += f"{prefill.name} too [{choice.decode_why}]"
    else:
        line += f"{_describe(decode, capability)} [{choice.decode_why}]"
        if prefill.leaves_decode_rows and decode.decodes_into:
            line += (
                f"; in mixed steps with {FlashAttnMetadataBuilder.min_decodes_apart}+ decode "
                f"rows, {decode.name} serves those"
            )
    if choice.passed_over:
        line += "; not used: " + "; ".join(choice.passed_over)
    return line


class FlashAttnMetadataBuilder(AttentionMetadataBuilder):
    min_decodes_apart: ClassVar[int] = 16
    """A mixed step leaves its decode rows to the decode kernel (a second launch) when it has at
    least this many and the kernels allow it; fewer ride along in the prefill kernel's launch."""

    def __init__(self, kv_cache_spec: KVCacheSpec, device: torch.device) -> None:
        super().__init__(kv_cache_spec, device)
        capability = gpu_capability(device)
        if capability is None:
            raise RuntimeError(f"FLASH_ATTN needs a CUDA GPU (the worker's device is {device})")
        spec = kv_cache_spec
        choice = choose_phases(capability, spec.head_size, spec.block_size)
        logger.info(startup_line(choice, capability, spec.block_size))
        self.prefill_kernel = choice.prefill(spec, device, capability)
        self.decode_kernel = (
            self.prefill_kernel
            if choice.decode is choice.prefill
            else choice.decode(spec, device, capability)
        )
        self.decodes_apart = (
            self.decode_kernel is not self.prefill_kernel
            and self.prefill_kernel.leaves_decode_rows
            and self.decode_kernel.decodes_into
        )

    def _metadata(
        self,
        common: CommonAttentionMetadata,
        prefill_kernel: AttentionKernel | None,
        decode_kernel: AttentionKernel | None,
        *,
        prefill_query_lens: torch.Tensor | None = None,
        prefill_plan: object = None,
        decode_plan: object = None,
        padded_slots: bool = False,
    ) -> FlashAttnMetadata:
        return FlashAttnMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            prefill_kernel=prefill_kernel,
            decode_kernel=decode_kernel,
            prefill_query_lens=prefill_query_lens,
            prefill_plan=prefill_plan,
            decode_plan=decode_plan,
            padded_slots=padded_slots,
        )

    def build(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        if common.max_query_len == 1:
            decode = self.decode_kernel
            plan = decode.plan_decode(common, common.num_reqs, for_graph=False)
            return self._metadata(common, None, decode, decode_plan=plan)
        prefill = self.prefill_kernel
        prefill_plan = prefill.plan_prefill(common)
        num_decodes = 0
        if self.decodes_apart:
            qsl = common.query_start_loc_cpu
            num_decodes = int(((qsl[1:] - qsl[:-1]) == 1).sum())
        if num_decodes < self.min_decodes_apart:
            return self._metadata(common, prefill, None, prefill_plan=prefill_plan)
        # Device arithmetic, queued before the forward pass: the prefill kernel's seqused_q gives
        # each one-token row no query tokens, so it leaves them to the decode kernel.
        query_lens = common.query_start_loc[1:] - common.query_start_loc[:-1]
        prefill_query_lens = torch.where(query_lens > 1, query_lens, 0).to(torch.int32)
        decode = self.decode_kernel
        return self._metadata(
            common,
            prefill,
            decode,
            prefill_query_lens=prefill_query_lens,
            prefill_plan=prefill_plan,
            decode_plan=decode.plan_decode(common, num_decodes, for_graph=False),
        )

    def build_for_cudagraph(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        # A decode-only batch padded to a capture size: the kernels read lengths on the device,
        # and the host bounds are the capture-time worst case (max_seq_len is max_model_len).
        decode = self.decode_kernel
        return self._metadata(
            common,
            None,
            decode,
            decode_plan=decode.plan_decode(common, common.num_reqs, for_graph=True),
            padded_slots=True,
        )

    def prepare_cudagraph_replay(
        self, attn_metadata: FlashAttnMetadata, common: CommonAttentionMetadata
    ) -> None:
        if attn_metadata.decode_kernel is not None:
            attn_metadata.decode_kernel.prepare_replay(attn_metadata.decode_plan, common)
