"""The machine a plan runs on, as a small value: what the step-time estimate needs.

``Machine`` holds one card's memory, its dense bf16 matmul rate and memory bandwidth as
measured (not the datasheet's), the launch cost of one kernel, and the bus bandwidths of
collectives inside a node (NVLink) and across nodes (the network), the host link, and
``gpus_per_node``. Presets for H100, H200, A100 and B200 carry the datasheet figures
scaled by what one such card reaches here; ``meshlab calibrate`` measures the card at
hand and writes a JSON file ``machine('path.json')`` reads back.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ._errors import ConfigError

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Machine:
    """One kind of card and its links. Rates in FLOP/s and bytes/s; ``launch`` in s."""

    name: str
    memory: int                    # bytes the framework can allocate on one card
    matmul: float                  # dense bf16 matmul FLOP/s reached (large GEMMs)
    hbm: float                     # device memory bandwidth reached (bytes/s, read+write)
    launch: float = 6e-6           # seconds per kernel launched by an eager step
    intra: float = 370e9           # collective bus bandwidth inside a node (bytes/s)
    inter: float = 45e9            # collective bus bandwidth across nodes, per card
    latency: float = 15e-6         # seconds per collective (start-up)
    host: float = 50e9             # host <-> device copy bandwidth (pinned, one way)
    gpus_per_node: int = 8
    attention: float = 0.0         # FLOP/s of fused attention (0: use matmul * 0.66)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Machine":
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ConfigError(f"machine profile: unknown fields {bad}; known {sorted(known)}")
        return cls(**d)

    def replace(self, **kw) -> "Machine":
        return dataclasses.replace(self, **kw)


# H200: measured on one H200 SXM (bf16 8192^3 matmul 799 TFLOP/s; copy 4.3 TB/s; pinned
# copies 55 GB/s; cuDNN attention fwd+bwd ~530 TFLOP/s); NVLink ring busBw ~370 GB/s with
# NVLS off. The others: datasheet peaks scaled by the H200's reached fractions.
PRESETS: dict[str, Machine] = {
    "h200": Machine("h200", memory=int(139.8 * GiB), matmul=790e12, hbm=4.3e12,
                    attention=530e12, host=55e9),
    "h100": Machine("h100", memory=int(79.2 * GiB), matmul=790e12, hbm=3.0e12,
                    attention=530e12, host=55e9),
    "a100": Machine("a100", memory=int(79.2 * GiB), matmul=250e12, hbm=1.8e12,
                    attention=180e12, intra=230e9, inter=22e9, host=24e9),
    "b200": Machine("b200", memory=int(178 * GiB), matmul=1800e12, hbm=7.0e12,
                    attention=1100e12, intra=740e9, inter=90e9, host=55e9),
}


def machine(spec) -> Machine:
    """A ``Machine`` from a preset name (``'h200'``), a JSON file or a Machine."""
    if isinstance(spec, Machine):
        return spec
    if isinstance(spec, str):
        if spec.lower() in PRESETS:
            return PRESETS[spec.lower()]
        path = Path(spec)
        if path.suffix == ".json" and path.exists():
            return Machine.from_json(json.loads(path.read_text()))
    raise ConfigError(f"machine {spec!r}: name one of {sorted(PRESETS)} or a JSON file written "
                      f"by `meshlab calibrate`")


def parse_memory(text: str) -> int:
    """``'141GB'``, ``'80GiB'``, ``'120e9'`` -> bytes."""
    t = str(text).strip()
    units = {"TIB": 2 ** 40, "GIB": GiB, "MIB": 2 ** 20, "TB": 1e12, "GB": 1e9, "MB": 1e6,
             "B": 1}
    for u, k in units.items():
        if t.upper().endswith(u):
            try:
                return int(float(t[:-len(u)]) * k)
            except ValueError:
                break
    try:
        return int(float(t))
    except ValueError:
        raise ConfigError(f"memory {text!r}: write it as 141GB, 80GiB or a number of bytes")
