"""Run as a script by test_families: load a target and print the anonymous memory (RssAnon) it took, at its peak
(sampled every 2 ms) and at the end, in MiB: python -m tests.engine._load_memory DIR DTYPE."""
import json
import sys
import threading
import time


def rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def main(source: str, dtype: str) -> None:
    from server.config import config_from_dict
    from server.engine import load_target

    base = rss_anon_kib()
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon_kib())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    cfg = config_from_dict({"model": {"source": source, "dtype": dtype, "device": "cpu"},
                            "cache": {"num_slots": 1, "max_seq_len": 512}})
    target = load_target(cfg, progress=False)
    done.set()
    sampler.join()
    print(json.dumps({"peak_mib": (peak[0] - base) / 1024, "end_mib": (rss_anon_kib() - base) / 1024,
                      "dtype": str(target.dtype)}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
