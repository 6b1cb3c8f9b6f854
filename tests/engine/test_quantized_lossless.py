"""The served GGUF model quantized as the file stores it (int4: Q4_1 layers, Q8_0 head) is the target: every
registered drafter returns plain decoding's tokens on it, greedy and seeded sampling, on whichever kernel path this
machine runs (the qlinear kernel with AVX-512 VNNI, PyTorch's packed kernels elsewhere)."""
from __future__ import annotations

import pytest

from core.sampling import SamplingParams
from drafters.base import create_drafter, drafter_names
from server.config import config_from_dict
from server.engine import Engine, load_target
from server.engine.quant import kernel_path
from tests.lossless import assert_lossless, plain_tokens, tokens_per_step

pytestmark = pytest.mark.slow

MAX_NEW = 24
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
DRAFTERS = {"none": {}, "ngram": {"num_tokens": 4}, "maxgram": {}, "glide": {}, "glide-cape": {},
            "glide-adaptive": {}, "cascade": {}, "falcon": {}, "falcon-adaptive": {}}


@pytest.fixture(scope="module")
def int4_config():
    return config_from_dict({"model": {"source": "embedded", "dtype": "float32", "device": "cpu",
                                       "quantization": "auto"},  # make serve's: the file's own int4 on a CPU
                             "cache": {"num_slots": 2, "max_seq_len": 512}})


@pytest.fixture(scope="module")
def int4_target(int4_config):
    return load_target(int4_config, progress=False)


@pytest.fixture(scope="module")
def plain(int4_config, int4_target, prompt_ids, stops):
    engine = Engine(int4_config, target=int4_target)
    return {sp: plain_tokens(engine, prompt_ids, MAX_NEW, stops, sp) for sp in (None, SAMPLED)}


def test_every_registered_drafter_is_covered_here():
    assert set(DRAFTERS) == set(drafter_names())


def test_the_target_runs_the_kernel_path_this_machine_has(int4_target):
    from specserve_kernels import cpu

    assert int4_target.quantization == "int4"  # model.quantization auto: the GGUF file's Q4_1 layers
    w = int4_target.model.layers[0].wqkv.weight
    want = "qlinear" if cpu.load() is not None else "aten"
    assert kernel_path("int4", int4_target.device) == want
    assert type(w).__name__ == ("BlockQuantWeight" if want == "qlinear" else "Int4Weight")
    if want == "qlinear":  # the head multiplies by the file's Q8_0 embedding, as llama.cpp's does
        assert int4_target.model.lm_head.weight.bits == 8 and w.bits == 4


def test_the_served_target_keeps_k_and_v_in_float16_and_sizes_its_slots_by_them(int4_config, int4_target):
    """The row-invariant CPU path stores K/V in float16 (half the bytes per cached token that a step reads), the
    hidden rows in float32; auto-sized pools count the narrower rows. Other paths keep the model's dtype."""
    import torch

    from server.engine.kv_cache import bytes_per_slot

    engine = Engine(int4_config, target=int4_target)
    want = torch.float16 if engine.exact_cpu else torch.float32
    assert engine.pool.k.dtype == engine.pool.v.dtype == want and engine.pool.hidden.dtype == torch.float32
    assert bytes_per_slot(30, 3, 512, 64, 576, torch.float32, torch.float16) == (2 * 30 * 3 * 64 * 2 + 576 * 4) * 512
    assert bytes_per_slot(30, 3, 512, 64, 576, torch.bfloat16) == (2 * 30 * 3 * 64 + 576) * 512 * 2


@pytest.mark.parametrize("name", ["falcon", "glide"])
def test_learned_drafters_run_the_targets_cpu_kernel_and_predict_as_their_dense_selves(int4_target, name):
    """On the qlinear path a learned drafter's matrices and LM-head rows are int8 blocks run by the same kernel (its
    forwards then cost a fraction of the dense float32 ones); its predictions stay those of the dense model: the
    same top token on nearly every input, logits within the int8 rounding."""
    import torch

    from drafters.checkpoint import drafter_weights
    from specserve_kernels import cpu

    if int4_target.kernels != "qlinear":
        pytest.skip(f"no qlinear path here: {cpu.unavailable_reason()}")
    drafter = create_drafter(name, int4_target, DRAFTERS[name])
    model = drafter.model
    quantized = [n for m in model.modules() for n, w in vars(m).items() if isinstance(w, cpu.BlockQuantWeight)]
    assert isinstance(model.head_weight, cpu.BlockQuantWeight) and len(quantized) >= 5, quantized
    assert not [n for n, p in model.named_parameters() if p.dim() == 2]  # no dense matrix left
    dense = create_drafter(name, int4_target, DRAFTERS[name]).model  # a fresh copy to undo the swap on
    for module in dense.modules():
        for key, w in list(vars(module).items()):
            if isinstance(w, cpu.BlockQuantWeight):
                setattr(module, key, w.dequantize())  # the int8 blocks' own values, multiplied densely
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(64, int4_target.args.hidden_size, generator=g)
    want, got = dense.logits(feats), model.logits(feats)
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9
    assert (want - got).abs().max() <= 0.05 * want.abs().max()
    assert drafter_weights(model, int4_target) is model  # nothing left to swap on a second call


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_and_seeded_speculation_equal_plain_on_the_quantized_target(int4_config, int4_target, prompt_ids,
                                                                           stops, plain, name):
    drafter = create_drafter(name, int4_target, DRAFTERS[name])
    spec = Engine(int4_config, drafter, int4_target)
    outs = assert_lossless(spec, prompt_ids, plain[None], MAX_NEW, stops, label=name)
    if name != "none":
        assert tokens_per_step(outs) > 1.0, name  # drafts were accepted, so verified rows stood for decode steps
    assert_lossless(spec, prompt_ids, plain[SAMPLED], MAX_NEW, stops, SAMPLED, label=f"{name} sampled")



def test_a_drafter_reading_lower_layers_gets_them_from_the_served_forward(int4_config, int4_target, prompt_ids,
                                                                          stops, plain, tmp_path):
    """A Falcon head that reads the residual stream after layers 3 and 15 (EAGLE-3's low and middle features) on the
    served target: the forward that keeps them (on the qlinear path, the compiled layer loop split at the taps)
    computes the same last-layer rows bit for bit, the kept rows are the layer-by-layer forward's within its
    rounding, and speculation with the head equals plain decoding."""
    import torch

    from drafters.falcon.drafter import FalconDrafter
    from drafters.falcon.model import FalconModel, default_checkpoint
    from training.falcon import with_taps

    head = with_taps(FalconModel.load(default_checkpoint(int4_target.model_id)), [3, 15], int4_target)
    with torch.no_grad():  # the shipped head with random tap weights: the taps change its drafts
        head.tap_fuse.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    head.save(tmp_path / "falcon-taps.safetensors", {"note": "test"}, dtype=torch.float32)
    spec = Engine(int4_config, FalconDrafter(int4_target, str(tmp_path / "falcon-taps.safetensors")), int4_target)
    base = Engine(int4_config, target=int4_target)
    W = int4_target.args.hidden_size
    ids = prompt_ids[0]
    a, b = spec.add(ids, max_new_tokens=1), base.add(ids, max_new_tokens=1)
    wide, top = spec.forward(a, ids), base.forward(b, ids)
    assert wide.shape == (len(ids), 3 * W) and torch.equal(wide[:, :W], top)
    def err(taps):  # relative distance per row (float16 K/V here, float32 in the layer-by-layer forward)
        own = int4_target.forward(ids, taps).taps.reshape(len(ids), -1)
        return float(((wide[:, W:] - own).norm(dim=-1) / own.norm(dim=-1)).max())

    assert err((3, 15)) < 0.05 < 0.2 < err((4, 16))  # those layers' rows, not their neighbours'
    spec.release(a)
    base.release(b)
    outs = assert_lossless(spec, prompt_ids, plain[None], MAX_NEW, stops, label="falcon with taps")
    assert tokens_per_step(outs) > 1.0
