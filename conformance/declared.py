"""What the harness knows of a backend: the data its class declares, never the class itself.

The class is imported, asked for its availability and described in a worker process
(``conformance.worker``), under the same isolation and timeout as its calls: a backend file
that crashes or hangs when imported costs that backend, not the run. What comes back is plain
data, validated here as if it came from anyone (it does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.backends.base import Backend, Capabilities, Conventions
from conformance.backends.registry import (
    SAFE_NAME,
    UnknownBackendError,
    availability_reason,
    backend_label,
    resolve,
)


@dataclass(frozen=True)
class Declared:
    """A backend's name, description, claims and conventions, and whether it can run here."""

    name: str
    description: str = ""
    capabilities: Capabilities = field(default_factory=Capabilities)
    conventions: Conventions = field(default_factory=Conventions)
    own_limits: bool = False  # the class overrides unsupported_reason: ask it, per case
    availability: str | None = None  # None: available; else why not

    @classmethod
    def of(cls, backend: type[Backend], label: str) -> Declared:
        """Read off a class; a declaration of the wrong type is refused naming the field."""
        for attribute, kind in (("capabilities", Capabilities), ("conventions", Conventions)):
            value = getattr(backend, attribute)
            if not isinstance(value, kind):
                raise UnknownBackendError(f"backend {label}: {attribute} is {value!r}, not a "
                                          f"{kind.__name__}")
        description = backend.description
        if not isinstance(description, str):
            raise UnknownBackendError(f"backend {label}: description is {description!r}, not "
                                      f"a string")
        return cls(label, description, backend.capabilities, backend.conventions,
                   backend.unsupported_reason is not Backend.unsupported_reason,
                   availability_reason(backend))

    @classmethod
    def unloadable(cls, name: str, reason: str) -> Declared:
        """A backend whose loading killed or hung its worker: unavailable, with the reason."""
        label = name.rpartition(":")[2] or name
        return cls(label if SAFE_NAME.fullmatch(label) else "unloadable", availability=reason)

    def as_data(self) -> dict:
        return {"name": self.name, "description": self.description,
                "capabilities": self.capabilities.as_data(),
                "conventions": self.conventions.as_data(), "own_limits": self.own_limits,
                "availability": self.availability}

    @classmethod
    def from_data(cls, data: object, target: str) -> Declared:
        """The declaration a worker sent, checked field by field."""
        fields = {"name", "description", "capabilities", "conventions", "own_limits",
                  "availability"}
        if not isinstance(data, dict) or set(data) != fields:
            raise UnknownBackendError(f"backend {target!r}: its worker described it as "
                                      f"{str(data)[:200]}, not {sorted(fields)}")
        name, availability = data["name"], data["availability"]
        if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
            raise UnknownBackendError(f"backend {target!r}: name {str(name)[:80]!r} is not "
                                      f"letters, digits and . _ + -")
        if availability is not None and not (isinstance(availability, str) and availability):
            raise UnknownBackendError(f"backend {target!r}: availability {availability!r}")
        if not isinstance(data["description"], str) or not isinstance(data["own_limits"], bool):
            raise UnknownBackendError(f"backend {target!r}: description or own_limits is not "
                                      f"a string and a bool")
        try:
            capabilities = Capabilities.from_data(data["capabilities"])
            conventions = Conventions.from_data(data["conventions"])
        except (TypeError, ValueError) as exc:
            raise UnknownBackendError(f"backend {target!r}: {exc}") from None
        return cls(name, data["description"], capabilities, conventions, data["own_limits"],
                   availability)


def describe_target(target: str) -> Declared:
    """Import a backend here and read its declaration (in a worker, or ``--in-process``)."""
    backend = resolve(target)
    return Declared.of(backend, backend_label(target, backend))
