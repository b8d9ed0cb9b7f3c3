"""The base of every topology section: unknown keys and non-finite numbers refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A topology section: an unknown key is an error (a typo never falls back to a
    default), and so is an inf or nan anywhere (every number of a topology is a finite
    count, size or rate); assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
