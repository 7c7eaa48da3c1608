"""Text encoding: a prompt encoded once is not encoded again while its encoder is loaded, and a
cached row is the very row an uncached encoding gives (each prompt is encoded alone)."""

import pytest
import torch

from wan_enhanced.pipeline import text
from wan_enhanced.pipeline.loading import load_text_encoder_handle
from wan_enhanced.pipeline.text import CACHED_PROMPTS, cached_prompts, encode_prompts
from tiny_sets import TE


@pytest.fixture
def encoder(ti2v_models):
    return load_text_encoder_handle(ti2v_models / "text_encoders" / TE, "fp32", "cpu")


@pytest.fixture
def counted(encoder, monkeypatch):
    """The rows each call of the encoder computes."""
    calls = []
    real = encoder.model.forward_each

    def forward_each(ids, *args, **kwargs):
        calls.append(ids.shape[0])
        return real(ids, *args, **kwargs)
    monkeypatch.setattr(encoder.model, "forward_each", forward_each)
    return calls


def test_a_repeated_prompt_costs_no_encoding_and_gives_the_same_rows(encoder, counted):
    a, b = encode_prompts(encoder, ["a red fox", "blurry, static"])
    assert counted == [2]
    a2, c = encode_prompts(encoder, ["a red fox", "a grey wolf"])
    assert counted == [2, 1]  # the new prompt only
    b2, a3 = encode_prompts(encoder, ["blurry, static", "a red fox"])
    assert counted == [2, 1]  # nothing
    assert torch.equal(a, a2) and torch.equal(a, a3) and torch.equal(b, b2)
    assert not torch.equal(a, c)
    # a fresh encoder object of the same file: its own cache, the same bits
    fresh = load_text_encoder_handle(encoder.info.path, "fp32", "cpu")
    assert cached_prompts(fresh) == 0
    for prompt, row in (("a red fox", a), ("a grey wolf", c), ("blurry, static", b)):
        assert torch.equal(encode_prompts(fresh, [prompt])[0], row)


def test_each_prompt_is_the_batch_forward_row(encoder):
    """Encoded alone or in a batch, the rows agree (to float32 rounding): the cache changes
    what runs, not what the DiT sees."""
    prompts = ["a red fox", "a much longer prompt about a grey wolf in the snow at dawn"]
    rows = encode_prompts(encoder, prompts)
    ids, mask = encoder.tokenizer(prompts)
    with torch.no_grad():
        batch = encoder.model(ids, mask).float() * mask[..., None]
    for i, row in enumerate(rows):
        assert row.shape == (1, 512, batch.shape[-1])
        assert torch.allclose(row[0], batch[i], rtol=1e-5, atol=1e-6)
        assert torch.all(row[0, int(mask[i].sum()):] == 0)


def test_the_cache_is_bounded_and_drops_the_oldest(encoder, counted):
    prompts = [" ".join(["fox"] * (i + 1)) for i in range(CACHED_PROMPTS + 3)]  # distinct ids
    for prompt in prompts:
        encode_prompts(encoder, [prompt])
    assert cached_prompts(encoder) == CACHED_PROMPTS
    assert len(counted) == CACHED_PROMPTS + 3
    encode_prompts(encoder, [prompts[-1]])  # kept
    assert len(counted) == CACHED_PROMPTS + 3
    encode_prompts(encoder, [prompts[0]])  # dropped: encoded again
    assert counted[-1] == 1 and len(counted) == CACHED_PROMPTS + 4


def test_returned_rows_are_the_callers_own(encoder):
    (row,) = encode_prompts(encoder, ["a red fox"])
    kept = row.clone()
    row.mul_(0)
    assert torch.equal(encode_prompts(encoder, ["a red fox"])[0], kept)


def test_an_interrupted_encoding_caches_nothing(encoder, monkeypatch):
    def stop(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(text, "_encode", stop)
    with pytest.raises(KeyboardInterrupt):
        encode_prompts(encoder, ["never finished"])
    assert cached_prompts(encoder) == 0


def test_a_stop_asked_during_the_encode_stops_it_between_blocks(encoder, counted):
    """Headless Ctrl-C / SIGTERM (host.request_interrupt) during a text encode: it stops at the
    next block (minutes of a CPU encode were not interruptible), and nothing is cached."""
    from wan_enhanced import host

    seen = []
    real = host.Progress.update_to

    def update_to(progress, value):
        seen.append(value)
        real(progress, value)
        if value == 1:
            host.request_interrupt()

    import unittest.mock
    with unittest.mock.patch.object(host.Progress, "update_to", update_to):
        try:
            with pytest.raises(host.Interrupted):
                encode_prompts(encoder, ["a red fox"])
        finally:
            host.clear_interrupt()
    assert seen == [1]  # stopped before the second block
    assert cached_prompts(encoder) == 0
    assert encode_prompts(encoder, ["a red fox"])[0].shape[1] == 512  # usable after
