"""The neutral vocabulary the engine and the drafters share; both import it, neither imports the other.

- ``core.tree``:     the draft tree (the drafter -> engine contract), the verification result, the 64-row limit
- ``core.sampling``: a request's sampling parameters, the target distribution they shape, the seeded generator
- ``core.ops``:      the Llama config, RoPE, RMSNorm, the linear layer (CPU kernel choice), the dtype table
"""
from core.ops import DTYPES, LlamaArgs, Rope, apply_rope, linear, rms_norm, rope_inv_freq
from core.sampling import GREEDY_TEMPERATURE, SamplingParams, request_generator, target_probs
from core.tree import MAX_TREE_ROWS, DraftTree, VerifyResult

__all__ = ["DTYPES", "GREEDY_TEMPERATURE", "MAX_TREE_ROWS", "DraftTree", "LlamaArgs", "Rope", "SamplingParams",
           "VerifyResult", "apply_rope", "linear", "request_generator", "rms_norm", "rope_inv_freq", "target_probs"]
