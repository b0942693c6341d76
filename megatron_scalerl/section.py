"""The base of every typed configuration section (the recipe's, a model family's own fields) and the constrained
number types their fields use. Layer 0: it imports pydantic only, so `families/` and `recipe/` both build on it."""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Pos = Annotated[int, Field(gt=0)]
NonNeg = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]


class Section(BaseModel):
    """Strict: no unknown keys, no silent type coercion (a string is not a number)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
