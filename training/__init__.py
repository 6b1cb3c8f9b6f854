"""Training pipelines for the drafters that learn: self-distilled data from the target, then GLIDE (and the bigram
table the Max-Gram drafter falls back on). Everything runs offline: no hub, no downloaded dataset."""
