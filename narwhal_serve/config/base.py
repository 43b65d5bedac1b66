"""The base of every config section: unknown keys are rejected (naming the key), values frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # (a .inf or .nan: refused)
