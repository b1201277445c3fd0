"""The one forward/backward schedule of a microbatch through the pipeline, whoever drives it (the trainer with routing
and retries, tests and benchmarks with a plain client): forward through stages 0..S-2, loss and its gradient at the
last stage, backward in reverse. Each stage call returns a `StageReply`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from trainer.client import StageReply

# (stage, "Forward" | "Backward", tensors by name, expected shape of the reply's tensor or None, the param_version that
# served the stage's Forward of this microbatch (Backward only, else None)) -> reply
StageCall = Callable[[int, str, dict[str, torch.Tensor], tuple[int, ...] | None, int | None], Awaitable[StageReply]]


async def train_microbatch(call: StageCall, n_stages: int, d_model: int, tokens: torch.Tensor, labels: torch.Tensor):
    """Returns the last stage's loss (None if it sent none). Every stage accumulates this microbatch's gradients."""
    B, T = tokens.shape
    hidden_BTD = (B, T, d_model)
    acts, versions = [tokens], []  # inputs of each stage (token ids, then hidden states); Forward's param versions
    for s in range(n_stages - 1):
        reply = await call(s, "Forward", {"inputs": acts[-1]}, hidden_BTD, None)
        acts.append(_tensor(reply))
        versions.append(reply.param_version)
    last = n_stages - 1
    reply = await call(last, "Backward", {"inputs": acts[-1], "labels": labels}, tuple(acts[-1].shape), None)
    loss, grad = reply.loss, _tensor(reply)
    for s in reversed(range(1, last)):
        reply = await call(s, "Backward", {"inputs": acts[s], "grad_outputs": grad}, tuple(acts[s].shape), versions[s])
        grad = _tensor(reply)
    if last > 0:  # stage 0's inputs are token ids: no gradient comes back
        await call(0, "Backward", {"inputs": acts[0], "grad_outputs": grad}, None, versions[0])
    return loss


def _tensor(reply: StageReply) -> torch.Tensor:
    if reply.tensor is None:  # the client checks replies against the expected shape: a tensor is there
        raise AssertionError("a stage reply without the tensor the schedule expects")
    return reply.tensor
