"""ctxrelay: let one LLM continue from context that a different LLM already prefilled."""

__version__ = "0.1.0"

__all__ = ["ContextState", "ModelPool", "load"]


def __getattr__(name: str):  # lazy, so `import ctxrelay` stays cheap and floors stay one-way
    if name == "load":
        from ctxrelay.zoo import load

        return load
    if name == "ModelPool":
        from ctxrelay.relay.api import ModelPool

        return ModelPool
    if name == "ContextState":
        from ctxrelay.state import ContextState

        return ContextState
    raise AttributeError(f"module 'ctxrelay' has no attribute {name!r}")
