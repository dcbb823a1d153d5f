"""`InputProducer`: a layer whose output is one linear layer's input (RMSNorm before qkv_proj and
gate_up_proj, SiluAndMul before down_proj), which may then write that input already quantized,
as the linear layer's quantization method asks (`LinearMethodBase.input_quantizer`): one kernel
in place of the producer's and the quantization's, and no float round trip between them.

A model pairs them when it builds its layers (``norm.feeds(qkv_proj)``); the loader binds the
pairs once the linear methods have processed their weights (`bind_input_quantizer`), since a
method knows its kernels only then. Unpaired, or paired with a method that offers no quantizer,
a producer returns plain activations as before."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.quantization.base import InputQuantizer

if TYPE_CHECKING:
    from pagellm.layers.linear import Linear


class InputProducer:
    """Mixed into an `nn.Module` whose output feeds one linear layer and nothing else."""

    # Class defaults: the pairing is set per instance by `feeds` and `bind_input_quantizer`.
    _consumer: tuple[Linear, ...] = ()
    input_quantizer: InputQuantizer | None = None

    def feeds(self, consumer: Linear) -> None:
        """Declare that this layer's output is ``consumer``'s input, and nobody else's (held in a
        tuple, not registered as a submodule: the consumer belongs where the model put it)."""
        self._consumer = (consumer,)

    def bind_input_quantizer(self) -> None:
        """Ask the consumer's method for its input quantizer (after the weights are processed)."""
        self.input_quantizer = None
        for consumer in self._consumer:
            self.input_quantizer = consumer.linear_method.input_quantizer(consumer)
