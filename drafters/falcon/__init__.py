"""The Falcon drafter: a semi-autoregressive drafting head over the target's features, with its decoding tree."""
