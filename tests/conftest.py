"""Shared fixtures: the real default model (loaded once per session) and tiny random Llama models."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch

# Triton picks interpreter or compiler when a kernel is decorated, i.e. on the first import of `specserve_kernels`, which any
# engine test triggers. This is the one place the choice is made: the interpreter only where there is no CUDA device
# (an explicit TRITON_INTERPRET wins), so on a GPU the kernel tests run compiled, bfloat16 included.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_SESSION_CACHE: str | None = None  # the cache directory this session made (removed at its end), if it made one


def pytest_configure(config):
    """Converted models, dtype/kernel/step-cost measurements and training work go to a directory of this session's
    own, not to the user's ~/.cache/specserve: set before any test loads a model, and inherited by the servers and
    CLIs the tests start (they copy os.environ). A cache directory the user set is used as it is, and kept."""
    global _SESSION_CACHE
    from server.model_files import CACHE_ENV

    if os.environ.get(CACHE_ENV) or _SESSION_CACHE is not None:
        return
    _SESSION_CACHE = tempfile.mkdtemp(prefix="specserve-test-cache-")
    os.environ[CACHE_ENV] = _SESSION_CACHE


def pytest_unconfigure(config):
    global _SESSION_CACHE
    from server.model_files import CACHE_ENV

    if _SESSION_CACHE is None:
        return
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
    if os.environ.get(CACHE_ENV) == _SESSION_CACHE:
        del os.environ[CACHE_ENV]
    _SESSION_CACHE = None


# The conftest fixtures that start a real `specserve serve`: a test that uses one, even through another fixture, is in
# the `server` tier (pyproject.toml) where its file forgot to say so.
SERVER_FIXTURES = frozenset({"server", "make_server", "live_server"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("server") is None:
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def fp32_config():
    from server.config import config_from_dict

    return config_from_dict({"model": {"dtype": "float32", "device": "cpu"},
                             "cache": {"num_slots": 2, "max_seq_len": 512}})


@pytest.fixture(scope="session")
def target32(fp32_config):
    """The embedded SmolLM2-135M-Instruct in float32 (its GGUF file's metadata read on first use, then cached)."""
    from server.engine import load_target

    return load_target(fp32_config, progress=False)


@pytest.fixture(scope="session")
def int4(target32):
    """(config, target): `make serve`'s target (the GGUF file's int4 on the qlinear kernel where the CPU has it) in
    float32."""
    from server.config import config_from_dict
    from server.engine import load_target

    cfg = config_from_dict({"model": {"source": "embedded", "dtype": "float32", "device": "cpu",
                                      "quantization": "auto"}, "cache": {"num_slots": 2, "max_seq_len": 512}})
    return cfg, load_target(cfg, progress=False)


@pytest.fixture(scope="session")
def tokenizer(target32):
    from server.model_files import load_tokenizer

    return load_tokenizer(target32.hf_dir)


@pytest.fixture(scope="session")
def stops(tokenizer, target32):
    """The default model's stop tokens (end of turn and end of text)."""
    from server.tokenization import stop_token_ids

    return stop_token_ids(tokenizer, target32.args.eos_token_ids)


@pytest.fixture(scope="session")
def hf_model32(target32):
    """transformers' own reading of the embedded GGUF file (``from_pretrained(gguf_file=...)``) in float32: the
    reference model, and the reference our GGUF reader is checked against (it reads nothing of ours but the path)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target32.gguf.parent, gguf_file=target32.gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(request, tokenizer):
    """The requesting test module's ``PROMPTS`` ([(kind, text)], as ``encode_prompts`` takes them), encoded."""
    return encode_prompts(tokenizer, request.module.PROMPTS)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    """tests.lossless.DRAFTER_PROMPTS encoded for the default model: a chat answer with code, a prose answer, a code
    completion (the drafters' lossless tests and the quantized target's)."""
    from tests.lossless import DRAFTER_PROMPTS

    return encode_prompts(tokenizer, DRAFTER_PROMPTS)


def encode_prompts(tokenizer, prompts: list[tuple[str, str]]) -> list[list[int]]:
    """("chat", text) -> one user message through the chat template; ("text", text) -> a raw completion prompt."""
    from server.tokenization import encode_record

    return [encode_record(tokenizer, {"messages": [{"role": "user", "content": t}]} if kind == "chat"
                          else {"prompt": t}) for kind, t in prompts]


def write_tiny_llama(path, vocab_size=16, hidden=32, layers=2, heads=4, kv_heads=2, rope_scaling=None, seed=0,
                     tie=True, embed_scale=3.0):
    """A random Llama saved by transformers itself (config.json + model.safetensors) into ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, rope_theta=500.0, rope_scaling=rope_scaling,
                      tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger logits than the default init, so distributions are far from uniform
        model.lm_head.weight.mul_(10.0) if not tie else model.model.embed_tokens.weight.mul_(embed_scale)
    model.save_pretrained(str(path))
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(d)
    return d


def bias_row(sp, like: torch.Tensor) -> torch.Tensor:
    """A request's logit_bias as a row shaped like ``like`` (zero for tokens without one): what shaping adds."""
    row = torch.zeros_like(like)
    for t, b in sp.logit_bias:
        row[t] = b
    return row


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of observed ``counts`` against exact ``probs`` (same shape, any rank).

    Fails outright when a cell of probability zero was observed; cells expected below 5 are pooled into one.
    """
    from scipy import stats

    n = counts.sum().item()
    counts, probs = counts.flatten().double(), probs.flatten().double()
    assert counts[probs == 0].sum() == 0, "a token of target probability zero was sampled"
    expected = probs * n
    big = expected >= 5  # pool the sparse cells into one, as chi-square needs
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * (obs.sum() / exp.sum())  # remove float round-off in the totals
    return stats.chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.fixture
def random_answers(tmp_path, target32):
    """A complete answers file (``train data``'s format) of 9 random short sequences: data for trainer runs that test
    the training plumbing, not what a drafter learns."""
    gen = torch.Generator().manual_seed(3)
    items = [{"prompt_ids": torch.randint(10, 400, (6,), generator=gen).tolist(),
              "response_ids": torch.randint(10, 400, (20,), generator=gen).tolist(), "source": "chat"}
             for _ in range(9)]
    path = tmp_path / "responses.pt"
    torch.save({"model_id": target32.model_id, "complete": True, "items": items}, path)
    return path


@pytest.fixture(scope="session")
def open_server(tmp_path_factory, target32):
    """The session's server without an API key (clients present any key, each key its own prefix-cache namespace),
    for the prefix-cache, benchmark and deployment tests. Its draft budget is ``fixed``: the goodput budget drafts
    only where this machine's measured step costs say it pays, and where it does not, no draft counter the
    deployment tests read would ever get a sample."""
    from tests.server.conftest import ServerProcess

    s = ServerProcess(tmp_path_factory.mktemp("open-srv"), api_key=None,
                      server_options={"draft_budget": "fixed"}).wait_ready()
    yield s
    s.stop()
