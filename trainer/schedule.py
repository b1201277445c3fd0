"""The one forward/backward schedule of a microbatch through the pipeline, whoever drives it (the trainer with routing
and retries, tests and benchmarks with a plain client): forward through stages 0..S-2, loss and its gradient at the
last stage, backward in reverse. Each stage call returns a `StageReply`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from swarm.protocol.tensors import EncodedTensor
from trainer.client import Admission, StageReply

# (stage, "Forward" | "Backward", tensors by name, expected shape of the reply's tensor or None, the param_version that
# served the stage's Forward of this microbatch (Backward only, else None), where stage 0 admitted the microbatch
# (None before it has)) -> reply
StageCall = Callable[
    [int, str, dict[str, torch.Tensor | EncodedTensor], tuple[int, ...] | None, int | None, Admission | None],
    Awaitable[StageReply],
]


@dataclass
class MicrobatchResult:
    loss: float | None  # the last stage's (None if it sent none)
    forward_versions: list[int]  # param_version of each stage that served this microbatch's forward (the last: its
    # Backward, which runs the forward itself)
    admission: Admission | None  # where stage 0 put it


async def train_microbatch(
    call: StageCall, n_stages: int, d_model: int, tokens: torch.Tensor, labels: torch.Tensor
) -> MicrobatchResult:
    """Forward and backward through every stage: each accumulates this microbatch's gradients."""
    B, T = tokens.shape
    hidden_BTD = (B, T, d_model)
    # inputs of each stage (token ids, then hidden states as the previous stage encoded them); Forward's param versions
    acts: list[torch.Tensor | EncodedTensor] = [tokens]
    versions: list[int] = []
    admission = None  # stage 0's Forward reply says which global batch the microbatch joins
    for s in range(n_stages - 1):
        reply = await call(s, "Forward", {"inputs": acts[-1]}, hidden_BTD, None, admission)
        acts.append(_tensor(reply))
        versions.append(reply.param_version)
        admission = admission or reply.admission
    last = n_stages - 1
    labelled = {"inputs": acts[-1], "labels": labels}
    reply = await call(last, "Backward", labelled, tuple(acts[-1].shape), None, admission)
    loss, grad = reply.loss, _tensor(reply)
    versions.append(reply.param_version)
    for s in reversed(range(1, last)):
        shape = tuple(acts[s].shape)
        grad = _tensor(
            await call(s, "Backward", {"inputs": acts[s], "grad_outputs": grad}, shape, versions[s], admission)
        )
    if last > 0:  # stage 0's inputs are token ids: no gradient comes back
        await call(0, "Backward", {"inputs": acts[0], "grad_outputs": grad}, None, versions[0], admission)
    return MicrobatchResult(loss, versions, admission)


def _tensor(reply: StageReply) -> EncodedTensor:
    """The reply's tensor as it came: the next call sends these bytes on (StageClient.call)."""
    if reply.encoded is None:  # the client checks replies against the expected shape: a tensor is there
        raise AssertionError("a stage reply without the tensor the schedule expects")
    return reply.encoded
