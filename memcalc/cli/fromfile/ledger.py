"""The ledger of a recipe file: each key read, typed, and what became of it: used (the option it set), not
modelled (it changes memory, and the verdict does not include it), ignored (it does not change memory), or
refused (one line, exit code 2). A key no reader names is not read."""

from __future__ import annotations

from dataclasses import dataclass, replace

from memcalc.errors import InputError
from memcalc.model.jsonfile import brief

USED, DEFAULT, OVERRIDDEN = "used", "default", "overridden"
NOT_MODELLED, IGNORED, NOT_READ = "not modelled", "ignored", "not read"
MISSING = object()
MAX_COUNT = 1 << 30  # no size, batch or rank in a recipe comes near it


@dataclass(frozen=True)
class KeyUse:
    """One key of the file: its dotted path, its value as written, and what memcalc made of it."""

    key: str
    value: str
    use: str  # USED, DEFAULT, OVERRIDDEN, NOT_MODELLED, IGNORED or NOT_READ
    note: str  # the option it set (--seq 2048), or why it is not in the verdict
    missing: str = ""  # what of a used key the verdict leaves out (paging of a paged optimizer)


@dataclass(frozen=True)
class Need:
    """A refusal that one of `options`, typed, lifts."""

    options: tuple[str, ...]
    key: str
    refusal: str
    replaces: bool  # the typed option stands in for the key (else it adds what the file cannot say)


class KeyLedger:
    """A file's keys as the readers take them: typed getters, and each key's use written down once. `options`
    gathers the options the keys set (by the commands' parameter names), `origin` which keys set each."""

    def __init__(self, path: str, data: dict) -> None:
        self.path, self.data = path, data
        self.options: dict[str, object] = {}
        self.origin: dict[str, list[str]] = {}
        self.uses: dict[str, KeyUse] = {}
        self.needs: list[Need] = []  # refusals that stand unless the user types an option deciding in their place
        self.remarks: list[str] = []  # what the whole file is taken as (the stack, and why)

    # reading
    def raw(self, key: str) -> object:
        """The value at a dotted key, MISSING where a part is absent (None where the file writes null)."""
        node: object = self.data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return MISSING
            node = node[part]
        return node

    def has(self, key: str) -> bool:
        return self.raw(key) not in (MISSING, None)

    def typed(self, key: str, kinds: tuple[type, ...], what: str) -> object:
        """The value at key if the file sets it (not null), of one of kinds; else None. A wrong type is refused."""
        value = self.raw(key)
        if value is MISSING or value is None:
            return None
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise InputError(f"{self.path}: {key} must be {what}, not {brief(value)}")
        return value

    def flag(self, key: str) -> bool | None:
        return self.typed(key, (bool,), "true or false")

    def count(self, key: str) -> int | None:
        value = self.typed(key, (int,), "a whole number")
        if value is not None and not 1 <= value <= MAX_COUNT:
            raise InputError(f"{self.path}: {key} must be a whole number from 1 to {MAX_COUNT:,}, not "
                             f"{brief(value)}")  # fmt: skip
        return value

    def number(self, key: str) -> float | None:
        value = self.typed(key, (int, float), "a number")
        return None if value is None else float(value)

    def text(self, key: str) -> str | None:
        return self.typed(key, (str,), "a string")

    def names(self, key: str) -> list[str] | None:
        """A list of strings, or one string (comma-separated in some files: q_proj,v_proj)."""
        value = self.typed(key, (list, str), "a list of names")
        if isinstance(value, str):
            return [x.strip() for x in value.split(",") if x.strip()]
        if value is not None and not all(isinstance(x, str) for x in value):
            raise InputError(f"{self.path}: {key} must be a list of names, not {brief(value)}")
        return value

    def section(self, key: str) -> dict | None:
        return self.typed(key, (dict,), "a mapping of keys")

    # what became of each key
    def shown(self, key: str) -> str:
        value = self.raw(key)
        if value is MISSING:
            return "(not set)"
        if value is None:
            return "null"
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, list) and all(isinstance(x, (str, int, float)) for x in value):
            value = "[" + ", ".join(str(x) for x in value) + "]"
        if isinstance(value, str) and len(value) > 32:  # a dotted name keeps its tail: ...llama2.lora_llama2_7b
            return "..." + value[-29:] if "." in value and " " not in value else value[:29] + "..."
        if isinstance(value, str):
            return value
        return brief(value) if isinstance(value, (list, dict)) else str(value)

    def note(self, key: str, use: str, note: str) -> None:
        """What became of key. A key used for several options (or parts of --tricks) gathers their notes; any
        other first note stands."""
        old = self.uses.get(key)
        if old is None:
            self.uses[key] = KeyUse(key, self.shown(key), use, note)
        elif use in (USED, DEFAULT) and old.use == use and note not in old.note:
            self.uses[key] = replace(old, note=f"{old.note}; {note}")

    def set(self, option: str, value: object, key: str, note: str | None = None) -> None:
        """The option set from key (or from several keys, one call each: --tricks)."""
        self.options[option] = value
        self.origin.setdefault(option, [])
        if key not in self.origin[option]:
            self.origin[option].append(key)
        self.note(key, USED, note or f"{flag_of(option)} {value}")

    def default(self, option: str | None, value: object, key: str, why: str, note: str | None = None) -> None:
        """A key the file leaves out, and the library's default for it that memcalc takes (TRL's max_length 1024),
        setting the option where one and its value are named (an option without a value: memcalc's own default
        stands in, which the option typed overrides)."""
        if option is not None and value is not None:
            self.options[option] = value
        if option is not None:
            self.origin.setdefault(option, [])
            if key not in self.origin[option]:
                self.origin[option].append(key)
        self.note(key, DEFAULT, f"{why}: {note or f'{flag_of(option)} {value}'}")

    def caveat(self, key: str, missing: str) -> None:
        """What the verdict leaves out of a key it uses."""
        self.uses[key] = replace(self.uses[key], missing=missing)

    def used(self, key: str, note: str) -> None:
        self.note(key, USED, note)

    def ignore(self, key: str, why: str) -> None:
        self.note(key, IGNORED, why)

    def unmodelled(self, key: str, why: str) -> None:
        self.note(key, NOT_MODELLED, why)

    def refuse(self, key: str, why: str) -> None:
        raise InputError(f"{self.path}: {key}: {self.shown(key)}: {why}")

    def refuse_unless(self, options: tuple[str, ...], key: str, why: str, replaces: bool = True) -> None:
        """A refusal that stands unless the user types one of the options: in the key's place (replaces), or
        supplying what the file cannot say (--gpus for a sharded recipe)."""
        self.needs.append(Need(options, key, f"{self.path}: {key}: {self.shown(key)}: {why}", replaces))


def flag_of(option: str) -> str:
    """A command's parameter as its flag: micro_batch -> --micro-batch."""
    return "--" + option.replace("_", "-")
