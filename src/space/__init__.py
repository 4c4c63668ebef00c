"""space: SPACE, sandboxes for long-running AI agents.

`from space import Space, AsyncSpace` loads the SDK lazily (module __getattr__): importing `space` itself
must stay free of third-party modules, because space.guest and the node helper's holder import this package
where only the standard library exists.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["AsyncSpace", "Space"]

if TYPE_CHECKING:
    from space.sdk import AsyncSpace, Space


def __getattr__(name: str) -> Any:
    if name in __all__:
        from space import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'space' has no attribute {name!r}")
