"""Extra teacher-forcing text from what the system ships: Python's standard library sources, Markdown docs under
/usr/share/doc and installed packages' descriptions. No download.

The target reads these texts in the teacher pass like its own answers (its K/V and next-token distributions are the
training signal), so the drafter sees far more contexts than the target's generated answers alone provide. The
answers stay in the mix: they are the distribution the drafter is verified against.
"""
from __future__ import annotations

import glob
import random
import sysconfig
from itertools import zip_longest
from pathlib import Path


def shipped_text_files() -> list[Path]:
    """Candidate files, in a fixed order (sorted paths per source)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    pats = [str(stdlib / "*.py"), "/usr/share/doc/**/*.md", str(purelib / "*.dist-info" / "METADATA")]
    out: list[Path] = []
    for pat in pats:
        out += sorted(Path(p) for p in glob.glob(pat, recursive=True) if Path(p).is_file())
    return out


def shipped_text_items(tokenizer, max_tokens: int, seq_len: int = 512, seed: int = 0) -> list[dict]:
    """Up to ``max_tokens`` tokens of shipped text cut into sequences of ``seq_len`` tokens (answer = whole chunk)."""
    rng = random.Random(seed)
    by_kind: dict[str, list[Path]] = {}
    for p in shipped_text_files():
        by_kind.setdefault(p.suffix or p.name, []).append(p)
    for files in by_kind.values():
        rng.shuffle(files)
    # Round-robin over the kinds (code, Markdown, package descriptions) so no single source dominates.
    order = [f for group in zip_longest(*by_kind.values()) for f in group if f is not None]
    items, total = [], 0
    for path in order:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids) - 32, seq_len):
            chunk = ids[s:s + seq_len]
            items.append({"prompt_ids": chunk[:1], "response_ids": chunk[1:], "source": f"text:{path.name}"})
            total += len(chunk)
            if total >= max_tokens:
                return items
    return items
