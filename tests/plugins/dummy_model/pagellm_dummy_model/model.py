"""A Llama whose LM head always favours one token, so its use is visible in the outputs."""

import torch

from pagellm.models.llama import LlamaForCausalLM

FAVOURED_TOKEN = 7


class DummyLlamaForCausalLM(LlamaForCausalLM):
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        logits[:, FAVOURED_TOKEN] += 1e4
        return logits
