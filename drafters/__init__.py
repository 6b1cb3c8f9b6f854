"""Pluggable drafters: each proposes a draft token tree for the engine to verify (see `drafters.base`)."""
from drafters.base import Drafter, create_drafter, drafter_names

__all__ = ["Drafter", "create_drafter", "drafter_names"]
