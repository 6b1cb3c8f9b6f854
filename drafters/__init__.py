"""Pluggable drafters: each proposes a draft token tree for the engine to verify (see `drafters.base`)."""
from drafters.base import DraftTree, Drafter, VerifyResult, create_drafter, drafter_names

__all__ = ["DraftTree", "Drafter", "VerifyResult", "create_drafter", "drafter_names"]
