"""swarm-generate: the sampler (pure), sampling from an exported file, and through a live in-process swarm."""

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from swarm.config import model_config
from swarm.model import GPT
from tools.generate import (
    BYTES,
    decode,
    load_model,
    main,
    model_next_logits,
    next_token,
    sample,
)

TINY = model_config("tiny_test", n_stages=2)
TINY_FLAGS = ["--preset", "tiny_test", "--n-stages", "2", "--device", "cpu"]


def fake_logits(ids) -> torch.Tensor:
    """Logits that depend on the context, as a model's do."""
    return torch.randn(BYTES, generator=torch.Generator().manual_seed(sum(ids) * 31 + len(ids)))


def draw(seed: int, n: int = 50, **kwargs) -> list[int]:
    kwargs = {"temperature": 1.0, "top_k": 0, **kwargs}
    return sample(fake_logits, [1, 2, 3], n, generator=torch.Generator().manual_seed(seed), **kwargs)


def test_the_sampler_is_deterministic_given_its_seed():
    assert draw(0) == draw(0)
    assert draw(0) != draw(1)
    assert len(draw(0, n=7)) == 7 and all(0 <= i < BYTES for i in draw(0))


def test_top_k_draws_only_among_the_k_likeliest():
    logits = torch.randn(BYTES, generator=torch.Generator().manual_seed(0))
    top3 = set(torch.topk(logits, 3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    drawn = [next_token(logits, 5.0, 3, gen) for _ in range(300)]  # hot: without top-k, anything would come
    assert set(drawn) == top3
    assert {next_token(logits, 5.0, 1, gen) for _ in range(20)} == {int(logits.argmax())}
    ties = torch.zeros(BYTES)  # all tied: still exactly k candidates
    assert len({next_token(ties, 1.0, 2, gen) for _ in range(200)}) == 2


@pytest.mark.parametrize("temperature", [0.0, 1e-4])
def test_temperature_towards_zero_is_the_argmax(temperature):
    greedy = draw(0, temperature=temperature)
    assert greedy == draw(1, temperature=temperature)
    ids = [1, 2, 3]
    for token in greedy:
        assert token == int(fake_logits(ids).argmax())
        ids.append(token)


def test_bad_logits_are_refused():
    gen = torch.Generator()
    with pytest.raises(ValueError, match="NaN or infinite"):
        next_token(torch.tensor([0.0, float("nan")]), 1.0, 0, gen)
    with pytest.raises(ValueError, match="vector"):
        next_token(torch.zeros(2, 3), 1.0, 0, gen)


@pytest.fixture
def exported(tmp_path):
    """A tiny random GPT saved as swarm-export writes it (keys `stages.{i}.{name}`); initialised from another seed than
    the flags' model, so that only weights read from the file can reproduce it."""
    model = GPT(dataclasses.replace(TINY, seed=7))
    assert all(k.startswith(("stages.0.", "stages.1.")) for k in model.state_dict())
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(path))
    return path, model


def test_greedy_generation_from_a_file_is_the_models_argmax(exported):
    path, model = exported
    loaded = load_model(path, TINY)
    ids = list(b"import ")
    new = sample(model_next_logits(loaded), ids, 10, 0.0, 0, torch.Generator())
    for token in new:  # GPT.forward returns the loss: the logits, stage by stage
        h = torch.tensor([ids[-TINY.max_seq_len :]])
        with torch.no_grad():
            for stage in model.stages:
                h = stage(h)
        assert token == int(h[0, -1, :BYTES].argmax())
        ids.append(token)


@pytest.mark.parametrize(
    "setup, flags, message",
    [
        ("missing", [], "no such file"),
        ("garbage", [], "not a readable safetensors file"),
        ("model", ["--d-model", "64", "--n-heads", "2"], "does not fit the model of these flags"),
        ("model", ["--n-stages", "3"], "missing"),
    ],
)
def test_a_bad_file_or_wrong_model_flags_fail_with_a_clear_error(exported, tmp_path, capsys, setup, flags, message):
    path = {"missing": tmp_path / "nope.safetensors", "model": exported[0]}.get(setup, tmp_path / "garbage")
    (tmp_path / "garbage").write_bytes(b"this is not a safetensors file")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(path), *TINY_FLAGS, *flags])
    assert exit_info.value.code not in (0, None)
    err = str(exit_info.value.code)
    assert message in err and str(path) in err


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "either --model FILE or --initial-peers"),
        (["--model", "m", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "exactly one"),
        (["--model", "m", "--temperature", "-1"], "--temperature"),
        (["--model", "m", "--prompt", ""], "--prompt"),
        (["--model", "m", "--vocab-size", "100", "--prompt", "é"], "--vocab-size"),
    ],
)
def test_bad_flags_are_refused_with_a_message(flags, message, capsys):
    with pytest.raises(SystemExit):
        main(flags)
    assert message in capsys.readouterr().err


def test_generate_from_an_exported_file(exported, capsys):
    path, model = exported
    prompt = "def fibonacci(n): return "  # longer than tiny_test's 16 tokens: the context is cropped
    main(["--model", str(path), *TINY_FLAGS, "--prompt", prompt, "--max-new-bytes", "30", "--seed", "3"])
    out = capsys.readouterr().out
    ids = list(prompt.encode())
    expected = sample(model_next_logits(model), ids, 30, 0.8, 40, torch.Generator().manual_seed(3))
    assert out == decode(ids + expected) + "\n"
    assert out.startswith(prompt)
