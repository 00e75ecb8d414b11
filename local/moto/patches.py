"""How the local stack's moto patches are declared and applied (the rule they follow: `local.moto`).

A `Patch` names what it replaces in moto (`replaces`: "module:Class.attribute" or "module:function"), its kind
(`BUG` or `SPEED`) and why, and makes its replacements from moto's own (`make`: given moto's objects in the order
of `replaces`, the replacements in the same order). `apply` puts them in place and keeps moto's; `unpatched()`
runs a block on moto's own and puts ours back after it, so that a test can show moto's answer beside ours
(tests/functional/test_moto_patches.py); `applied()` applies patches for a block only (the local server's, in a
test process).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["bug", "speed"]
BUG: Kind = "bug"  # moto answers otherwise than AWS: the patch makes it answer as AWS does
SPEED: Kind = "speed"  # moto's answers, unchanged, for less work


@dataclass(frozen=True)
class Patch:
    name: str
    kind: Kind
    replaces: tuple[str, ...]  # moto's objects it replaces: "moto.s3.models:FakeKey.value"
    why: str
    make: Callable[..., tuple[object, ...]]  # moto's objects (as `replaces` lists them) -> their replacements
    server_only: bool = False  # only where the local server serves each request whole (`local.server`)
    needs: tuple[str, ...] = ()  # patches this one relies on (their replacements understand what it makes)

    def __post_init__(self) -> None:
        if self.kind not in (BUG, SPEED):
            raise ValueError(f"{self.name}: a patch is a bug fix or for speed, not {self.kind!r}")
        if not self.replaces or any(target.count(":") != 1 for target in self.replaces):
            raise ValueError(f"{self.name}: what it replaces, as 'module:name', one or more: {self.replaces}")


_ABSENT = object()  # (an attribute moto's class does not define itself: removed again when undone)


@dataclass(frozen=True)
class _Slot:
    owner: Any  # a class or module of moto's
    attribute: str
    target: str
    moto: object  # what the owner itself held (_ABSENT: nothing)
    ours: object


_lock = threading.RLock()
_applied: dict[str, tuple[Patch, tuple[_Slot, ...]]] = {}
_undone = False  # inside unpatched(): moto's own in place


def _resolve(target: str) -> tuple[Any, str]:
    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    *owners, attribute = path.split(".")
    for name in owners:
        owner = getattr(owner, name)
    return owner, attribute


def apply(patches: Iterable[Patch]) -> list[Patch]:
    """Put each patch not yet applied in place, in order; the ones it applied. Each of moto's objects is replaced by
    one patch at most."""
    done = []
    with _lock:
        if _undone:
            raise RuntimeError("moto is unpatched for a block (unpatched()): apply after it")
        for patch in patches:
            if patch.name in _applied:
                continue
            missing = [name for name in patch.needs if name not in _applied]
            if missing:
                raise RuntimeError(f"{patch.name} needs {missing} applied first")
            taken = {slot.target: name for name, (_, slots) in _applied.items() for slot in slots}
            resolved = [_resolve(target) for target in patch.replaces]
            for target in patch.replaces:
                if target in taken:
                    raise RuntimeError(f"{patch.name} replaces {target}, which {taken[target]} replaces already")
            ours = patch.make(*(inspect.getattr_static(owner, attribute, None) for owner, attribute in resolved))
            if len(ours) != len(resolved):
                raise RuntimeError(f"{patch.name} made {len(ours)} replacements for {len(resolved)} targets")
            slots = tuple(_Slot(owner, attribute, target, vars(owner).get(attribute, _ABSENT), replacement)
                          for (owner, attribute), target, replacement in zip(resolved, patch.replaces, ours,
                                                                            strict=True))
            _put(slots, ours=True)
            _applied[patch.name] = (patch, slots)
            done.append(patch)
    return done


def _put(slots: Iterable[_Slot], ours: bool) -> None:
    for slot in slots:
        value = slot.ours if ours else slot.moto
        if value is _ABSENT:
            delattr(slot.owner, slot.attribute)
        else:
            setattr(slot.owner, slot.attribute, value)


def remove(patch: Patch) -> None:
    """Put moto's own back for one patch (no other applied patch may need it)."""
    with _lock:
        if _undone:
            raise RuntimeError("moto is unpatched for a block (unpatched()): remove after it")
        if patch.name not in _applied:
            return
        needed_by = [name for name, (other, _) in _applied.items() if patch.name in other.needs]
        if needed_by:
            raise RuntimeError(f"{needed_by} need {patch.name}")
        _, slots = _applied.pop(patch.name)
        _put(reversed(slots), ours=False)


def is_applied(name: str) -> bool:
    return name in _applied and not _undone


def original(target: str) -> Any:
    """moto's own object that an applied patch replaced ("module:Class.attribute")."""
    for _, slots in _applied.values():
        for slot in slots:
            if slot.target == target:
                if slot.moto is _ABSENT:
                    raise KeyError(f"moto itself defines no {target}")
                return slot.moto
    raise KeyError(f"no applied patch replaces {target}")


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """moto's own, as it is released, for the block; every applied patch back in place after it. Not while
    anything else uses moto in this process (another thread would see moto unpatched meanwhile)."""
    global _undone
    with _lock:
        if _undone:
            raise RuntimeError("unpatched() within unpatched()")
        slots = [slot for _, patch_slots in _applied.values() for slot in patch_slots]
        _put(reversed(slots), ours=False)
        _undone = True
    try:
        yield
    finally:
        with _lock:
            _put(slots, ours=True)
            _undone = False


@contextlib.contextmanager
def applied(patches: Iterable[Patch]) -> Iterator[None]:
    """The patches applied for the block; those it applied removed after it."""
    done = apply(patches)
    try:
        yield
    finally:
        for patch in reversed(done):
            remove(patch)


def argument(function: Callable[..., Any], name: str) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """Reads the argument `name` of a call to `function` (as `function(*args, **kwargs)` would bind it: by name or
    by position, else its default), so that a replacement forwarding `*args, **kwargs` depends on no position."""
    signature = inspect.signature(function)
    default = signature.parameters[name].default
    default = None if default is inspect.Parameter.empty else default

    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return signature.bind(*args, **kwargs).arguments.get(name, default)

    return read
