"""How often a prefix-cache hit leaves a request's output unchanged, in a given dtype.

In float32 a hit changes nothing (tested, every drafter). In 16-bit the rows after the hit are computed in a chunk
that starts elsewhere, and a CPU's bfloat16 GEMMs are not bit-identical across row counts, so a near-tie argmax can
flip. For each prompt of a prompts file this runs a second chat turn (the first turn's answer appended, then a new
question) with the first turn cached and with the cache off, and counts equal outputs; beside it, the fraction of
prompts whose speculative output (``--drafter``) equals plain decoding's with the cache off, for comparison.

    python -m server.bench.prefix_equality --dtype bfloat16 --prompts deploy/prompts/bench.jsonl --drafter glide-cape
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from drafters.base import create_drafter
from server.config import load_config
from server.engine import Engine, load_target
from server.model_files import load_tokenizer
from server.tokenization import encode_chat, read_prompts, stop_token_ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none")
    p.add_argument("--prompts", default="deploy/prompts/bench.jsonl")
    p.add_argument("--limit", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--drafter", default="glide-cape", help="for the speculative-vs-plain fraction beside it")
    a = p.parse_args(argv)
    cfg = load_config(a.config).with_overrides(dtype=a.dtype, quantization=a.quantization, device="cpu")
    off_cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, prefix_caching=False, num_slots=2))
    on_cfg = dataclasses.replace(off_cfg, cache=dataclasses.replace(off_cfg.cache, prefix_caching=True))
    target = load_target(on_cfg)
    tok = load_tokenizer(target.hf_dir)
    stops = stop_token_ids(tok, target.args.eos_token_ids)
    on, off = Engine(on_cfg, target=target), Engine(off_cfg, target=target)
    spec = Engine(off_cfg, create_drafter(a.drafter, target, cfg.drafter.options_for(a.drafter)), target)
    hit_equal = spec_equal = n = 0
    for item in read_prompts(a.prompts)[:a.limit]:
        if "messages" not in item:
            continue
        turn1 = item["messages"]
        answer = on.generate(encode_chat(tok, turn1), None, a.max_tokens, stops).token_ids  # cached now
        turn2 = encode_chat(tok, turn1 + [{"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)},
                                          {"role": "user", "content": "Say that again in fewer words."}])
        before = on.prefix.hits
        got = on.generate(turn2, None, a.max_tokens, stops).token_ids
        assert on.prefix.hits > before, "the second turn did not hit"
        want = off.generate(turn2, None, a.max_tokens, stops).token_ids
        hit_equal += got == want
        spec_equal += spec.generate(turn2, None, a.max_tokens, stops).token_ids == want
        n += 1
    print(json.dumps({"dtype": a.dtype, "quantization": a.quantization, "prompts": n,
                      "hit_equal_fraction": round(hit_equal / n, 3), "drafter": a.drafter,
                      "speculative_equal_fraction": round(spec_equal / n, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
