"""The base of every request body the server reads: OpenAI's strictness."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator


class OpenAIModel(BaseModel):
    """Strict types, unknown fields refused, no NaN or infinity; ``null`` means the field's default."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: object) -> object:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data
