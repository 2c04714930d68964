"""What the engine answers a request it cannot take."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot take; `param` names the offending parameter."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
